rule pretrain:
    input:
        encoded="results/encoded/pretrain.bin",
        tokenizer="results/tokenizer/tokenizer.json",
        kernels=KERNELS,
        code=package(*ENGINE, "train", "checkpoint", "data"),
    output:
        checkpoint="results/pretrain/model.ckpt",
        log_csv="results/pretrain/log.csv",
    params:
        model=config["model"],
        settings=config["pretrain"],
        device=config["device"],
    conda:
        "../envs/clgpt.yaml"
    log:
        "logs/pretrain.log",
    benchmark:
        "benchmarks/pretrain.tsv"
    script:
        "../scripts/pretrain.py"
