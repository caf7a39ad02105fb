rule evaluate:
    input:
        pretrained="results/pretrain/model.ckpt",
        tuned="results/tune/model.ckpt",
        tokenizer="results/tokenizer/tokenizer.json",
        pretrain_heldout="results/encoded/pretrain_heldout.bin",
        tune_heldout="results/encoded/tune_heldout.bin",
        tune_dialogs=TUNE_DIALOGS,
        heldout_dialogs=config["corpus"]["tune_heldout"],
        pretrain_log="results/pretrain/log.csv",
        tune_log="results/tune/log.csv",
        kernels=KERNELS,
        code=package(*ENGINE, "evaluate", "generate", "checkpoint", "data", "chat"),
    output:
        metrics="results/eval/metrics.json",
        report="results/eval/report.md",
        plots=expand("results/eval/loss_{stage}.png", stage=["pretrain", "tune"]),
    log:
        "logs/evaluate.log",
    benchmark:
        "benchmarks/evaluate.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
        runtime=config["resources"]["evaluate"]["runtime"],
        gpu=config["resources"]["evaluate"]["gpu"],
    params:
        settings=config["evaluate"],
        device=config["device"],
    script:
        "../scripts/evaluate.py"
