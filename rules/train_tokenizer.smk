rule train_tokenizer:
    input:
        pretrain=PRETRAIN_TEXT,
        tune=TUNE_DIALOGS,
        code=package("tokenizer", "data"),
    output:
        tokenizer="results/tokenizer/tokenizer.json",
        vocab="results/tokenizer/vocab.txt",
    log:
        "logs/train_tokenizer.log",
    benchmark:
        "benchmarks/train_tokenizer.tsv"
    conda:
        "../envs/clgpt.yaml"
    params:
        settings=config["tokenizer"],
        corpus=config["corpus"],
    script:
        "../scripts/train_tokenizer.py"
