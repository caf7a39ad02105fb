rule encode:
    input:
        tokenizer="results/tokenizer/tokenizer.json",
        pretrain=PRETRAIN_TEXT,
        pretrain_heldout=config["corpus"]["pretrain_heldout"] or [],
        tune=TUNE_DIALOGS,
        tune_heldout=TUNE_DIALOGS_HELDOUT,
        code=stage_code("encode"),
    output:
        **{part: f"results/encoded/{part}.bin" for part in ENCODED_PARTS},
        sidecars=expand("results/encoded/{part}.json", part=ENCODED_PARTS),
        index=expand("results/encoded/{part}.idx", part=ENCODED_PARTS),
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
        corpus=config["corpus"],
        n_ctx=config["model"]["n_ctx"],
    script:
        "../scripts/encode.py"
