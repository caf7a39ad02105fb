# Sweeps: `snakemake --cores N sweep`. Every combination of the `sweep:` lists in config.yaml is a run named after its
# values (e.g. `lr-0.001_n_layer-1`). A stage that a swept key touches runs once per run and writes under
# results/sweep/{run}/; a stage that none touches is the usual one at results/ and runs once for all runs (a sweep over
# training settings shares one tokenizer and one encode). Each run ships models/{run}.gguf; results/sweep/summary.*
# ranks the runs by held-out loss. Each sweep_X rule is the stage's rule X (its script, code inputs, threads and
# resources) with the run's paths and settings.
include: "sweep_common.smk"


wildcard_constraints:
    run="|".join(re.escape(name) for name in SWEEP_RUNS) or "(?!)",


rule sweep:
    input:
        expand("models/{run}.gguf", run=list(SWEEP_RUNS)),
        "results/sweep/summary.md",
        "results/sweep/summary.csv",
        "results/sweep/summary.png",


rule sweep_summary:
    input:
        metrics=sweep_outputs("eval", "metrics.json"),
        logs=sweep_outputs("pretrain", "log.csv"),
        code=summary_code(),
    output:
        csv="results/sweep/summary.csv",
        md="results/sweep/summary.md",
        png="results/sweep/summary.png",
    log:
        "logs/sweep/summary.log",
    benchmark:
        "benchmarks/sweep/summary.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["sweep_summary"]["threads"]
    resources:
        mem_mb=config["resources"]["sweep_summary"]["mem_mb"],
        runtime=config["resources"]["sweep_summary"]["runtime"],
    params:
        runs={name: run["overrides"] for name, run in SWEEP_RUNS.items()},
    script:
        "../scripts/sweep_summary.py"


use rule train_tokenizer as sweep_train_tokenizer with:
    input:
        pretrain=rules.train_tokenizer.input.pretrain,
        tune=rules.train_tokenizer.input.tune,
        **rule_code("train_tokenizer"),
    output:
        tokenizer="results/sweep/{run}/tokenizer/tokenizer.json",
        vocab="results/sweep/{run}/tokenizer/vocab.txt",
    log:
        "logs/sweep/{run}/train_tokenizer.log",
    benchmark:
        "benchmarks/sweep/{run}/train_tokenizer.tsv"
    params:
        settings=sweep_setting("tokenizer"),


use rule encode as sweep_encode with:
    input:
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        pretrain=rules.encode.input.pretrain,
        tune=rules.encode.input.tune,
        pretrain_heldout=rules.encode.input.pretrain_heldout,
        tune_heldout=rules.encode.input.tune_heldout,
        **rule_code("encode"),
    output:
        pretrain="results/sweep/{run}/encoded/pretrain.bin",
        pretrain_heldout="results/sweep/{run}/encoded/pretrain_heldout.bin",
        tune="results/sweep/{run}/encoded/tune.bin",
        tune_heldout="results/sweep/{run}/encoded/tune_heldout.bin",
        sidecars=expand(
            "results/sweep/{{run}}/encoded/{part}.json", part=ENCODED_PARTS
        ),
    log:
        "logs/sweep/{run}/encode.log",
    benchmark:
        "benchmarks/sweep/{run}/encode.tsv"
    params:
        n_ctx=sweep_setting("model", "n_ctx"),


use rule pretrain as sweep_pretrain with:
    input:
        encoded=sweep_input("encoded", "pretrain.bin"),
        heldout=sweep_input("encoded", "pretrain_heldout.bin"),
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        **rule_code("pretrain"),
    output:
        checkpoint="results/sweep/{run}/pretrain/model.ckpt",
        log_csv="results/sweep/{run}/pretrain/log.csv",
    log:
        "logs/sweep/{run}/pretrain.log",
    benchmark:
        "benchmarks/sweep/{run}/pretrain.tsv"
    params:
        # what rules.pretrain's shell line reads (rules/common.smk stage_command), from the run's config
        settings=sweep_script_settings(model="model", settings="pretrain", device="device", devices="devices"),
        paths=script_paths("encoded", "heldout", "tokenizer", "checkpoint", "log_csv"),


use rule tune as sweep_tune with:
    input:
        pretrained=sweep_input("pretrain", "model.ckpt"),
        encoded=sweep_input("encoded", "tune.bin"),
        heldout=sweep_input("encoded", "tune_heldout.bin"),
        mix=sweep_input("encoded", "pretrain.bin"),
        **rule_code("tune"),
    output:
        checkpoint="results/sweep/{run}/tune/model.ckpt",
        log_csv="results/sweep/{run}/tune/log.csv",
    log:
        "logs/sweep/{run}/tune.log",
    benchmark:
        "benchmarks/sweep/{run}/tune.tsv"
    params:
        settings=sweep_script_settings(settings="tune", device="device", devices="devices"),
        paths=script_paths("pretrained", "encoded", "heldout", "mix", "checkpoint", "log_csv"),


use rule evaluate as sweep_evaluate with:
    input:
        pretrained=sweep_input("pretrain", "model.ckpt"),
        tuned=sweep_input("tune", "model.ckpt"),
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        pretrain_heldout=sweep_input("encoded", "pretrain_heldout.bin"),
        tune_heldout=sweep_input("encoded", "tune_heldout.bin"),
        tune_dialogs=TUNE_DIALOGS,  # as rules.evaluate (whose input lacks them without a tune stage)
        heldout_dialogs=TUNE_DIALOGS_HELDOUT,
        pretrain_log=sweep_input("pretrain", "log.csv"),
        tune_log=sweep_input("tune", "log.csv"),
        **rule_code("evaluate"),
    output:
        metrics="results/sweep/{run}/eval/metrics.json",
        report="results/sweep/{run}/eval/report.md",
        plots=expand(
            "results/sweep/{{run}}/eval/loss_{stage}.png", stage=["pretrain", "tune"]
        ),
    log:
        "logs/sweep/{run}/evaluate.log",
    benchmark:
        "benchmarks/sweep/{run}/evaluate.tsv"
    params:
        settings=sweep_setting("evaluate"),
        device=sweep_setting("device"),


use rule export as sweep_export with:
    input:
        model=sweep_input("tune" if TUNE else "pretrain", "model.ckpt"),  # as rules.export's FINAL_CKPT
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        metrics=sweep_input("eval", "metrics.json"),
        **rule_code("export"),
    output:
        gguf="models/{run}.gguf",
        modelfile="models/{run}.Modelfile",
    log:
        "logs/sweep/{run}/export.log",
    benchmark:
        "benchmarks/sweep/{run}/export.tsv"
    params:
        settings=sweep_setting("export"),
