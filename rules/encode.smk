rule encode:
    input:
        tokenizer="results/tokenizer/tokenizer.json",
        pretrain=PRETRAIN_TEXT,
        tune=TUNE_DIALOGS,
        pretrain_heldout=config["corpus"]["pretrain_heldout"],
        tune_heldout=config["corpus"]["tune_heldout"],
        code=package("tokenizer", "data", "chat"),
    output:
        pretrain="results/encoded/pretrain.bin",
        pretrain_heldout="results/encoded/pretrain_heldout.bin",
        tune="results/encoded/tune.bin",
        tune_heldout="results/encoded/tune_heldout.bin",
        sidecars=expand(
            "results/encoded/{part}.json",
            part=["pretrain", "pretrain_heldout", "tune", "tune_heldout"],
        ),
    log:
        "logs/encode.log",
    benchmark:
        "benchmarks/encode.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["encode"]["threads"]
    resources:
        mem_mb=config["resources"]["encode"]["mem_mb"],
        runtime=config["resources"]["encode"]["runtime"],
    params:
        n_ctx=config["model"]["n_ctx"],
    script:
        "../scripts/encode.py"
