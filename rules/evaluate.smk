rule evaluate:
    input:
        pretrained="results/pretrain/model.ckpt",
        tokenizer="results/tokenizer/tokenizer.json",
        pretrain_heldout="results/encoded/pretrain_heldout.bin",
        pretrain_log="results/pretrain/log.csv",
        **(
            {
                "tuned": "results/tune/model.ckpt",
                "tune_heldout": "results/encoded/tune_heldout.bin",
                "tune_log": "results/tune/log.csv",
                "tune_dialogs": TUNE_DIALOGS,
                "heldout_dialogs": TUNE_DIALOGS_HELDOUT,
                **({"accept": config["corpus"]["tune_accept"]} if config["corpus"].get("tune_accept") else {}),
            }
            if TUNE
            else {}
        ),
        code=stage_code("evaluate"),
    output:
        metrics="results/eval/metrics.json",
        report=report(
            "results/eval/report.md",
            caption="../report/evaluation.rst",
            category="Evaluation",
        ),
        plots=report(
            expand(
                "results/eval/loss_{stage}.png",
                stage=["pretrain", "tune"] if TUNE else ["pretrain"],
            ),
            caption="../report/loss.rst",
            category="Training",
        ),
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
        corpus=config["corpus"],
        settings=config["evaluate"],
        device=config["device"],
    script:
        "../scripts/evaluate.py"
