rule export:
    input:
        model=FINAL_CKPT,
        tokenizer="results/tokenizer/tokenizer.json",
        metrics="results/eval/metrics.json",
        code=stage_code("export"),
        **LORA_EXPORT_INPUT,
    output:
        gguf=staged("model.gguf"),
        modelfile=staged("Modelfile"),
        **LORA_EXPORT_OUTPUT,
    log:
        "logs/export.log",
    benchmark:
        "benchmarks/export.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["export"]["threads"]
    resources:
        mem_mb=config["resources"]["export"]["mem_mb"],
        runtime=config["resources"]["export"]["runtime"],
    params:
        settings=config["export"],
    script:
        "../scripts/export.py"


# `snakemake --cores 1 hf`: the same model as a Hugging Face folder beside model.gguf (not part of `all`)
rule hf:
    input:
        model=FINAL_CKPT,
        tokenizer="results/tokenizer/tokenizer.json",
        code=stage_code("export_hf"),
    output:
        config="hf/config.json",
        weights="hf/model.safetensors",
        tokenizer="hf/tokenizer.json",
        tokenizer_config="hf/tokenizer_config.json",
        generation_config="hf/generation_config.json",
    log:
        "logs/export_hf.log",
    benchmark:
        "benchmarks/export_hf.tsv"
    conda:
        "../envs/clgpt.yaml"
    threads: config["resources"]["export"]["threads"]
    resources:
        mem_mb=config["resources"]["export"]["mem_mb"],
        runtime=config["resources"]["export"]["runtime"],
    script:
        "../scripts/export_hf.py"
