"""Evaluation: held-out loss, forgetting, exact-match answers and the report, in the field's units.

    evaluate.py   the evaluate stage: losses, probes, samples, the report and its plots
    answers.py    greedy answers to every assistant turn and their exact-match scores; a sample of the tune set
    accept.py     whether a held-out reply carries the expected fact or act (rules in data), by language
    units.py      bits per byte of a held-out loss; the tokenizer report against tiktoken's cl100k_base
"""
