#!/bin/bash
# One device call (issue 15): nanoGPT's shakespeare_char GPU recipe (6 layers, 6 heads, 384 channels, context 256,
# batch 64, 5000 steps, dropout 0.2, evaluations every 250 steps) as nanoGPT's own train.py runs it (torch.compile,
# bf16 autocast), then clgpt's pretrain stage with configs/shakespeare_char_gpu.yaml at precision PRECISION (bf16
# unless given), one after the other on the same GPU, each timed as a whole (compile, evaluations and checkpoints
# included). Needs what bench/run_gpu_char.sh needs (text/, .nanogpt/, results/ from the CPU stages), carried:
#   run(carry=[".whl", "text", ".nanogpt", "results"], command="bash bench/run_gpu_char_speed.sh")
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0 PRECISION=${PRECISION:-bf16}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
( cd .nanogpt && t0=$(date +%s.%N); PYTHONPATH= timeout 200 python3 train.py config/train_shakespeare_char.py \
    --dataset=austen_char --out_dir=/tmp/nanogpt_out > $OUT/nanogpt.log 2>&1
  echo "nanogpt train.py rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a $OUT/nanogpt.log )
rm -rf results/pretrain; t0=$(date +%s.%N)
timeout 230 python3 - > $OUT/clgpt.log 2>&1 <<'PY'
import os, runpy
from clgpt.config import load_workflow_config
cfg = load_workflow_config("config.yaml", configfiles=["configs/shakespeare_char_gpu.yaml"])
cfg["pretrain"]["precision"] = os.environ["PRECISION"]
main = runpy.run_path("scripts/pretrain.py")["main"]
main(encoded="results/encoded/pretrain.bin", heldout="results/encoded/pretrain_heldout.bin",
     tokenizer="results/tokenizer/tokenizer.json", model=cfg["model"], settings=cfg["pretrain"], device=cfg["device"],
     checkpoint="results/pretrain/model.ckpt", log_csv="results/pretrain/log.csv")
PY
echo "clgpt pretrain stage ($PRECISION) rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a $OUT/clgpt.log
grep -E "step (2000|5000):" $OUT/nanogpt.log | tail -2
python3 -c "
import csv; rows = [r for r in csv.DictReader(open('results/pretrain/log.csv')) if r.get('val_loss')]
print('clgpt best held-out loss', min(float(r['val_loss']) for r in rows), 'at step', min(rows, key=lambda r: float(r['val_loss']))['step'])
# where the stage's time went: the steps (tokens / tokens_per_s of each step) and the rest between the first and
# last logged step (evaluations, checkpoints, logging); before the first step: start-up, setup, kernel builds
rows = list(csv.DictReader(open('results/pretrain/log.csv')))
steps = sum(16384 / float(r['tokens_per_s']) for r in rows)
span = float(rows[-1]['elapsed_s'])
print(f'clgpt steps {steps:.1f} s ({1e3 * steps / len(rows):.2f} ms a step, {len(rows)} steps), '
      f'logged span {span:.1f} s, between steps {span - steps:.1f} s')"
grep -E "^iter (100|1000|2000|3000|4000|4900):" $OUT/nanogpt.log
cp results/pretrain/log.csv $OUT/clgpt_log.csv
