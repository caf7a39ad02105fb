rule export:
    input:
        model=FINAL_CKPT,
        tokenizer="results/tokenizer/tokenizer.json",
        metrics="results/eval/metrics.json",
        code=package("model", "gguf_io", "checkpoint", "tokenizer", "chat"),
    output:
        gguf="model.gguf",
        modelfile="Modelfile",
    log:
        "logs/export.log",
    benchmark:
        "benchmarks/export.tsv"
    conda:
        "../envs/clgpt.yaml"
    params:
        settings=config["export"],
    script:
        "../scripts/export.py"
