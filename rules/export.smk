rule export:
    input:
        tuned="results/tune/model.ckpt",
        tokenizer="results/tokenizer/tokenizer.json",
        metrics="results/eval/metrics.json",
        code=package("model", "gguf_io", "checkpoint", "tokenizer", "chat"),
    output:
        gguf="model.gguf",
        modelfile="Modelfile",
    params:
        settings=config["export"],
    conda:
        "../envs/clgpt.yaml"
    log:
        "logs/export.log",
    benchmark:
        "benchmarks/export.tsv"
    script:
        "../scripts/export.py"
