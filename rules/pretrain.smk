rule pretrain:
    input:
        encoded="results/encoded/pretrain.bin",
        heldout="results/encoded/pretrain_heldout.bin",
        tokenizer="results/tokenizer/tokenizer.json",
        kernels=KERNELS,
        code=package(*ENGINE, "train", "checkpoint", "data"),
    output:
        checkpoint="results/pretrain/model.ckpt",
        log_csv="results/pretrain/log.csv",
    log:
        "logs/pretrain.log",
    benchmark:
        "benchmarks/pretrain.tsv"
    conda:
        "../envs/clgpt.yaml"
    params:
        model=config["model"],
        settings=config["pretrain"],
        device=config["device"],
    script:
        "../scripts/pretrain.py"
