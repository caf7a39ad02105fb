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
        args=script_args(
            pretrained=lambda i, o: i.pretrained,
            encoded=lambda i, o: i.encoded,
            mix=lambda i, o: i.mix,
            settings=config["tune"],
            device=config["device"],
            devices=config["devices"],
            checkpoint=lambda i, o: o.checkpoint,
            log_csv=lambda i, o: o.log_csv,
        ),
    shell:
        stage_command("tune", "scripts/tune.py")
