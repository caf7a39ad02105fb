rule train_tokenizer:
    input:
        pretrain=PRETRAIN_TEXT,
        tune=TUNE_DIALOGS,
        code=package("tokenizer", "data"),
    output:
        tokenizer="results/tokenizer/tokenizer.json",
        vocab="results/tokenizer/vocab.txt",
    params:
        settings=config["tokenizer"],
    conda:
        "../envs/clgpt.yaml"
    log:
        "logs/train_tokenizer.log",
    benchmark:
        "benchmarks/train_tokenizer.tsv"
    script:
        "../scripts/train_tokenizer.py"
