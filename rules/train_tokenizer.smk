rule train_tokenizer:
    input:
        pretrain=PRETRAIN_TEXT,
        tune=TUNE_DIALOGS,
        code=stage_code("train_tokenizer"),
    output:
        tokenizer="results/tokenizer/tokenizer.json",
        vocab="results/tokenizer/vocab.txt",
    log:
        "logs/train_tokenizer.log",
    benchmark:
        "benchmarks/train_tokenizer.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["train_tokenizer"]["threads"]
    resources:
        mem_mb=config["resources"]["train_tokenizer"]["mem_mb"],
        runtime=config["resources"]["train_tokenizer"]["runtime"],
    params:
        settings=config["tokenizer"],
        corpus=config["corpus"],
    script:
        "../scripts/train_tokenizer.py"
