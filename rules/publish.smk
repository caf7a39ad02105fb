# The files a user keeps (model.gguf and Modelfile, the training stages' model.ckpt and log.csv) are written
# by their stage under results/staging/ and published by these rules: a hard link and one rename each
# (clgpt.atomic.publish). Snakemake deletes a job's outputs before it runs and after it fails; for a stage
# those are its staging files, so a stage that fails (a full disk) or is stopped leaves the previous
# model.gguf, Modelfile and checkpoints as they were.


# One output a job: Snakemake touches a job's outputs one by one after it ends, then fails the job if an output
# is older than an input. A published file shares its inode with its staged input, so touching a second output
# would make its staged input newer than the first output whenever the two touches fall in different clock
# ticks. For the same reason a job takes no other job's staged file as an input: publishing that file later
# would leave this job's output older than it, and every later run would publish again. model.gguf's job takes
# the published Modelfile (the generic rule below publishes it) instead.
rule publish_model:
    input:
        unpack(publish_model_input),
    output:
        "model.gguf",
    log:
        "logs/publish_model.log",
    benchmark:
        "benchmarks/publish_model.tsv"
    params:
        settings=config["export"],
    localrule: True
    run:
        publish(input.staged, output[0])
        drop_stale_lora()


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
