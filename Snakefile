# clgpt: tokenizer -> encode -> pretrain -> tune -> evaluate -> export (model.gguf + Modelfile).
# `snakemake --cores 1 model.gguf`; see README.md and ARCHITECTURE.md.
# Settings: config.yaml (plus any --configfile / --config), read and validated in rules/common.smk.
from snakemake.utils import min_version

min_version("8.0")


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/train_tokenizer.smk"
include: "rules/encode.smk"
include: "rules/pretrain.smk"
include: "rules/tune.smk"
include: "rules/evaluate.smk"
include: "rules/export.smk"
include: "rules/publish.smk"
include: "rules/sweep.smk"


rule all:
    default_target: True
    input:
        "model.gguf",
        "Modelfile",
        "results/eval/report.md",
