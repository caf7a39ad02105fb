rule export:
    input:
        model=FINAL_CKPT,
        tokenizer="results/tokenizer/tokenizer.json",
        metrics="results/eval/metrics.json",
        code=stage_code("export"),
        **LORA_EXPORT_INPUT,
    output:
        gguf="model.gguf",
        modelfile="Modelfile",
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
