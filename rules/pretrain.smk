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
        settings=script_settings(model=config["model"], settings=config["pretrain"], device=config["device"], devices=config["devices"]),
        paths=script_paths("encoded", "tokenizer", "checkpoint", "log_csv"),
    shell:
        stage_command("pretrain", "scripts/pretrain.py")
