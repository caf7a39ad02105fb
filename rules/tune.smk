rule tune:
    input:
        pretrained="results/pretrain/model.ckpt",
        encoded="results/encoded/tune.bin",
        mix="results/encoded/pretrain.bin",
        kernels=KERNELS,
        code=[*package(*ENGINE, "train", "checkpoint", "data", "chat", "dist", "stage"), "scripts/tune.py"],
    output:
        checkpoint="results/tune/model.ckpt",
        log_csv="results/tune/log.csv",
    log:
        "logs/tune.log",
    benchmark:
        "benchmarks/tune.tsv"
    conda:
        "../envs/clgpt.yaml"
    resources:
        **mpi_resources("tune"),
    params:
        settings=script_settings(settings=config["tune"], device=config["device"], devices=config["devices"]),
        paths=script_paths("pretrained", "encoded", "mix", "checkpoint", "log_csv"),
    shell:
        stage_command("tune", "scripts/tune.py")
