# Sweeps: `snakemake --cores N sweep`. Every combination of the `sweep:` lists in config.yaml is a run named after its
# values (e.g. `lr-0.001_n_layer-1`). A stage that a swept key touches runs once per run and writes under
# results/sweep/{run}/; a stage that none touches is the usual one at results/ and runs once for all runs (a sweep over
# training settings shares one tokenizer and one encode). Each run ships models/{run}.gguf; results/sweep/summary.*
# ranks the runs by held-out loss. The rules reuse the stage scripts, code inputs and resources of the stages.
import re

from clgpt.sweep import stage_dir, sweep_runs, varied_stages

try:
    SWEEP_RUNS = sweep_runs(config)
except ClgptError as e:
    sys.exit(f"error: {e}")
SWEEP_VARIED = varied_stages(config["sweep"])
ENCODED_PARTS = ["pretrain", "pretrain_heldout", "tune", "tune_heldout"]


wildcard_constraints:
    run="|".join(re.escape(name) for name in SWEEP_RUNS) or "(?!)",


def sweep_input(stage, path):
    """Input function: `path` of the run's own `stage` when the sweep varies it, else the shared one."""

    def input_path(wildcards):
        return f"{stage_dir(stage, wildcards.run, SWEEP_VARIED)}/{path}"

    return input_path


def sweep_setting(*keys):
    """Params function: the run's value of config[keys[0]][keys[1]]..."""

    def value(wildcards):
        v = SWEEP_RUNS[wildcards.run]["config"]
        for k in keys:
            v = v[k]
        return v

    return value


def sweep_outputs(stage, path):
    """Every run's file `path` of `stage` (its own or the shared one), in run order."""
    return [
        f"{stage_dir(stage, run, SWEEP_VARIED)}/{path}" for run in SWEEP_RUNS
    ]


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
        code=package("sweep", "config", "atomic"),
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


rule sweep_train_tokenizer:
    input:
        pretrain=rules.train_tokenizer.input.pretrain,
        tune=rules.train_tokenizer.input.tune,
        code=rules.train_tokenizer.input.code,
    output:
        tokenizer="results/sweep/{run}/tokenizer/tokenizer.json",
        vocab="results/sweep/{run}/tokenizer/vocab.txt",
    log:
        "logs/sweep/{run}/train_tokenizer.log",
    benchmark:
        "benchmarks/sweep/{run}/train_tokenizer.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["train_tokenizer"]["threads"]
    resources:
        mem_mb=config["resources"]["train_tokenizer"]["mem_mb"],
        runtime=config["resources"]["train_tokenizer"]["runtime"],
    params:
        settings=sweep_setting("tokenizer"),
    script:
        "../scripts/train_tokenizer.py"


rule sweep_encode:
    input:
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        pretrain=rules.encode.input.pretrain,
        tune=rules.encode.input.tune,
        pretrain_heldout=rules.encode.input.pretrain_heldout,
        tune_heldout=rules.encode.input.tune_heldout,
        code=rules.encode.input.code,
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
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["encode"]["threads"]
    resources:
        mem_mb=config["resources"]["encode"]["mem_mb"],
        runtime=config["resources"]["encode"]["runtime"],
    params:
        n_ctx=sweep_setting("model", "n_ctx"),
    script:
        "../scripts/encode.py"


rule sweep_pretrain:
    input:
        encoded=sweep_input("encoded", "pretrain.bin"),
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        kernels=rules.pretrain.input.kernels,
        code=rules.pretrain.input.code,
    output:
        checkpoint="results/sweep/{run}/pretrain/model.ckpt",
        log_csv="results/sweep/{run}/pretrain/log.csv",
    log:
        "logs/sweep/{run}/pretrain.log",
    benchmark:
        "benchmarks/sweep/{run}/pretrain.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["pretrain"]["threads"]
    resources:
        mem_mb=config["resources"]["pretrain"]["mem_mb"],
        runtime=config["resources"]["pretrain"]["runtime"],
        gpu=config["resources"]["pretrain"]["gpu"],
    params:
        model=sweep_setting("model"),
        settings=sweep_setting("pretrain"),
        device=sweep_setting("device"),
    script:
        "../scripts/pretrain.py"


rule sweep_tune:
    input:
        pretrained=sweep_input("pretrain", "model.ckpt"),
        encoded=sweep_input("encoded", "tune.bin"),
        mix=sweep_input("encoded", "pretrain.bin"),
        kernels=rules.tune.input.kernels,
        code=rules.tune.input.code,
    output:
        checkpoint="results/sweep/{run}/tune/model.ckpt",
        log_csv="results/sweep/{run}/tune/log.csv",
    log:
        "logs/sweep/{run}/tune.log",
    benchmark:
        "benchmarks/sweep/{run}/tune.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["tune"]["threads"]
    resources:
        mem_mb=config["resources"]["tune"]["mem_mb"],
        runtime=config["resources"]["tune"]["runtime"],
        gpu=config["resources"]["tune"]["gpu"],
    params:
        settings=sweep_setting("tune"),
        device=sweep_setting("device"),
    script:
        "../scripts/tune.py"


rule sweep_evaluate:
    input:
        pretrained=sweep_input("pretrain", "model.ckpt"),
        tuned=sweep_input("tune", "model.ckpt"),
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        pretrain_heldout=sweep_input("encoded", "pretrain_heldout.bin"),
        tune_heldout=sweep_input("encoded", "tune_heldout.bin"),
        tune_dialogs=rules.evaluate.input.tune_dialogs,
        heldout_dialogs=rules.evaluate.input.heldout_dialogs,
        pretrain_log=sweep_input("pretrain", "log.csv"),
        tune_log=sweep_input("tune", "log.csv"),
        kernels=rules.evaluate.input.kernels,
        code=rules.evaluate.input.code,
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
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
        runtime=config["resources"]["evaluate"]["runtime"],
        gpu=config["resources"]["evaluate"]["gpu"],
    params:
        settings=sweep_setting("evaluate"),
        device=sweep_setting("device"),
    script:
        "../scripts/evaluate.py"


rule sweep_export:
    input:
        tuned=sweep_input("tune", "model.ckpt"),
        tokenizer=sweep_input("tokenizer", "tokenizer.json"),
        metrics=sweep_input("eval", "metrics.json"),
        code=rules.export.input.code,
    output:
        gguf="models/{run}.gguf",
        modelfile="models/{run}.Modelfile",
    log:
        "logs/sweep/{run}/export.log",
    benchmark:
        "benchmarks/sweep/{run}/export.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["export"]["threads"]
    resources:
        mem_mb=config["resources"]["export"]["mem_mb"],
        runtime=config["resources"]["export"]["runtime"],
    params:
        settings=sweep_setting("export"),
    script:
        "../scripts/export.py"
