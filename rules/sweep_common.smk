# What rules/sweep.smk needs: the sweep's runs (validated at parse time) and the input, params and code
# functions of its rules.
import json
import re

from clgpt.training.sweep import stage_dir, sweep_runs, varied_stages

try:
    SWEEP_RUNS = sweep_runs(config)
    # the targets are not known while the Snakefile is read; the command line names them (`snakemake ... sweep`)
    if not config.get("sweep") and "sweep" in sys.argv[1:]:
        raise ClgptError("`sweep` runs the combinations of the config's `sweep:` section, and it has none; add "
                         "one (e.g. `sweep: {pretrain.lr: [0.003, 0.001]}`, docs/sweeps.md) or ask for model.gguf")
except ClgptError as e:
    sys.exit(f"error: {e}")
SWEEP_VARIED = varied_stages(config["sweep"])
ENCODED_PARTS = ["pretrain", "pretrain_heldout", "tune", "tune_heldout"]


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


def sweep_script_settings(**sections):
    """params.settings of a training stage in a run (as rules/common.smk script_settings): main(...)'s keyword
    arguments {argument: config section or top-level key} from the run's config, as one JSON string."""

    def settings(wildcards):
        run = SWEEP_RUNS[wildcards.run]["config"]
        return script_settings(**{k: run[key] for k, key in sections.items()})

    return settings


def summary_code():
    """Code inputs of sweep_summary: its script's import graph where rules/common.smk has stage_code, else the
    modules it imports."""
    if "stage_code" in globals():
        return stage_code("sweep_summary")
    return [*package("sweep", "config", "atomic", "stage"), "scripts/sweep_summary.py"]


def rule_code(rule):
    """The code inputs (kernels, package modules) of a stage's own rule: editing them re-runs the sweep's runs too."""
    inputs = getattr(rules, rule).input
    return {k: inputs[k] for k in ("kernels", "code") if k in inputs.keys()}


def sweep_outputs(stage, path):
    """Every run's file `path` of `stage` (its own or the shared one), in run order."""
    return [
        f"{stage_dir(stage, run, SWEEP_VARIED)}/{path}" for run in SWEEP_RUNS
    ]
