rule tune:
    input:
        pretrained="results/pretrain/model.ckpt",
        encoded="results/encoded/tune.bin",
        mix="results/encoded/pretrain.bin",
        kernels=KERNELS,
        code=package(*ENGINE, "train", "checkpoint", "data", "chat"),
    output:
        checkpoint="results/tune/model.ckpt",
        log_csv="results/tune/log.csv",
    params:
        settings=config["tune"],
        device=config["device"],
    conda:
        "../envs/clgpt.yaml"
    log:
        "logs/tune.log",
    benchmark:
        "benchmarks/tune.tsv"
    script:
        "../scripts/tune.py"
