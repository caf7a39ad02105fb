rule tune:
    input:
        pretrained="results/pretrain/model.ckpt",
        encoded="results/encoded/tune.bin",
        heldout="results/encoded/tune_heldout.bin",
        mix="results/encoded/pretrain.bin",
        code=stage_code("tune"),
    output:
        checkpoint=staged("results/tune/model.ckpt"),
        log_csv=staged("results/tune/log.csv"),
    log:
        "logs/tune.log",
    benchmark:
        "benchmarks/tune.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["tune"]["threads"]
    resources:
        mem_mb=config["resources"]["tune"]["mem_mb"],
        runtime=config["resources"]["tune"]["runtime"],
        gpu=config["resources"]["tune"]["gpu"],
        **mpi_resources("tune"),
    params:
        settings=script_settings(settings=config["tune"], device=config["device"], devices=config["devices"]),
        paths=script_paths("pretrained", "encoded", "heldout", "mix", "checkpoint", "log_csv"),
    shell:
        stage_command("tune", "scripts/tune.py")
