"""The evaluate stage's main, timed, with the clgpt of CODE_ROOT (a checkout of any commit: `git archive COMMIT
clgpt kernels scripts schemas | tar -x -C DIR`) on this checkout's results/ and config.yaml. Run it with two
roots, one after the other, to compare a change's stage time and exact-match counts on the same checkpoints.

    python bench/evaluate_ab.py CODE_ROOT OUT_DIR      (from the checkout, after `snakemake model.gguf`)
"""
import json
import os
import sys
import time

code, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
sys.path.insert(0, code)
sys.path.insert(0, os.path.join(code, "scripts"))
import clgpt  # noqa: E402
from clgpt.config import load_workflow_config  # noqa: E402
from clgpt.data.preflight import check_corpus  # noqa: E402

import evaluate as script  # noqa: E402  (CODE_ROOT/scripts/evaluate.py)

assert clgpt.__file__.startswith(code), clgpt.__file__
cfg = load_workflow_config("config.yaml")
corpus = check_corpus(cfg["corpus"])
inp = {"pretrained": "results/pretrain/model.ckpt", "tuned": "results/tune/model.ckpt",
       "tokenizer": "results/tokenizer/tokenizer.json", "pretrain_heldout": "results/encoded/pretrain_heldout.bin",
       "tune_heldout": "results/encoded/tune_heldout.bin", "pretrain_log": "results/pretrain/log.csv",
       "tune_log": "results/tune/log.csv"}
os.makedirs(out, exist_ok=True)
t0, c0 = time.perf_counter(), time.process_time()
script.main(inp, list(corpus["tune"]), dict(cfg["corpus"]), dict(cfg["evaluate"]), cfg["device"],
            os.path.join(out, "metrics.json"))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
m = json.load(open(os.path.join(out, "metrics.json")))
print(json.dumps({"code": code, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                  "exact": {k: (v["matches"], v["total"]) for k, v in m["exact_match"].items()}}))
