# The files a user keeps (model.gguf and Modelfile, the training stages' model.ckpt and log.csv) are written
# by their stage under results/staging/ and published by these rules: a hard link and one rename each
# (clgpt.atomic.publish). Snakemake deletes a job's outputs before it runs and after it fails; for a stage
# those are its staging files, so a stage that fails (a full disk) or is stopped leaves the previous
# model.gguf, Modelfile and checkpoints as they were.


rule publish_model:
    input:
        unpack(publish_model_input),
    output:
        gguf="model.gguf",
        modelfile="Modelfile",
    log:
        "logs/publish_model.log",
    benchmark:
        "benchmarks/publish_model.tsv"
    params:
        settings=config["export"],
    localrule: True
    run:
        publish_all([(input.gguf, output.gguf), (input.modelfile, output.modelfile)])


rule publish:
    input:
        unpack(publish_input),
    output:
        "{published}",
    wildcard_constraints:
        published=PUBLISHED_PATTERN,
    log:
        "logs/publish/{published}.log",
    benchmark:
        "benchmarks/publish/{published}.tsv"
    params:
        settings=publish_settings,
    localrule: True
    run:
        publish(input.staged, output[0])
