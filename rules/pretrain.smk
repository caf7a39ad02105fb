rule pretrain:
    input:
        encoded="results/encoded/pretrain.bin",
        heldout="results/encoded/pretrain_heldout.bin",
        tokenizer="results/tokenizer/tokenizer.json",
        code=stage_code("pretrain"),
    output:
        checkpoint=staged("results/pretrain/model.ckpt"),
        log_csv=staged("results/pretrain/log.csv"),
    log:
        "logs/pretrain.log",
    benchmark:
        "benchmarks/pretrain.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["pretrain"]["threads"]
    resources:
        mem_mb=config["resources"]["pretrain"]["mem_mb"],
        runtime=config["resources"]["pretrain"]["runtime"],
        gpu=config["resources"]["pretrain"]["gpu"],
        **mpi_resources("pretrain"),
    params:
        settings=script_settings(model=config["model"], settings=config["pretrain"], device=config["device"], devices=config["devices"]),
        paths=script_paths("encoded", "heldout", "tokenizer", "checkpoint", "log_csv"),
    shell:
        stage_command("pretrain", "scripts/pretrain.py")
