rule pretrain:
    input:
        encoded="results/encoded/pretrain.bin",
        tokenizer="results/tokenizer/tokenizer.json",
        kernels=KERNELS,
        code=[*package(*ENGINE, "train", "checkpoint", "data", "dist", "stage"), "scripts/pretrain.py"],
    output:
        checkpoint="results/pretrain/model.ckpt",
        log_csv="results/pretrain/log.csv",
    log:
        "logs/pretrain.log",
    benchmark:
        "benchmarks/pretrain.tsv"
    conda:
        "../envs/clgpt.yaml"
    resources:
        **mpi_resources("pretrain"),
    params:
        args=script_args(
            encoded=lambda i, o: i.encoded,
            tokenizer=lambda i, o: i.tokenizer,
            model=config["model"],
            settings=config["pretrain"],
            device=config["device"],
            devices=config["devices"],
            checkpoint=lambda i, o: o.checkpoint,
            log_csv=lambda i, o: o.log_csv,
        ),
    shell:
        stage_command("pretrain", "scripts/pretrain.py")
