"""Evaluation: held-out loss, forgetting, exact-match answers and the report, in the field's units.

    evaluate.py   the evaluate stage: losses, probes, samples, the report and its plots
    units.py      bits per byte of a held-out loss; the tokenizer report against tiktoken's cl100k_base
"""
