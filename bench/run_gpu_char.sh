#!/bin/bash
# One device call (issue 12): nanoGPT's shakespeare_char GPU recipe (6 layers, 6 heads, 384 channels, context 256,
# batch 64, 5000 steps, lr 1e-3 -> 1e-4, dropout 0.2) beside clgpt's pretrain stage with configs/shakespeare_char_gpu.yaml,
# on the same text and the same GPU, at the same time (so their wall times here are not a speed comparison).
# Needs text/austen.txt (bench/austen_text.py) and .nanogpt/ (nanoGPT's train.py, model.py, configurator.py,
# config/train_shakespeare_char.py, data/austen_char/{train,val}.bin + meta.pkl from its prepare.py, and
# /work/nanogpt/heldout_loss.py), both carried:  run(carry=[".whl", "text", ".nanogpt"], command="bash bench/run_gpu_char.sh")
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
nvidia-smi --query-gpu=name,driver_version --format=csv
( cd .nanogpt && t0=$(date +%s); PYTHONPATH= python3 train.py config/train_shakespeare_char.py \
    --dataset=austen_char --out_dir=/tmp/nanogpt_out > $OUT/nanogpt.log 2>&1; echo "nanogpt wall $(( $(date +%s) - t0 )) s" >> $OUT/nanogpt.log ) &
NANO=$!
# The device has no snakemake: the tokenizer and encode stages ran beforehand on the CPU (same bytes on any device:
#   snakemake --cores 1 results/encoded/pretrain.bin results/encoded/pretrain_heldout.bin --configfile configs/shakespeare_char_gpu.yaml)
# and results/ is carried; the pretrain stage runs here through its script's main, with the config the workflow would give it.
rm -rf results/pretrain; t0=$(date +%s)
timeout 520 python3 - > $OUT/clgpt.log 2>&1 <<'PY'
import runpy
from clgpt.config import load_workflow_config
cfg = load_workflow_config("config.yaml", configfiles=["configs/shakespeare_char_gpu.yaml"])
main = runpy.run_path("scripts/pretrain.py")["main"]
main(encoded="results/encoded/pretrain.bin", heldout="results/encoded/pretrain_heldout.bin",
     tokenizer="results/tokenizer/tokenizer.json", model=cfg["model"], settings=cfg["pretrain"], device=cfg["device"],
     checkpoint="results/pretrain/model.ckpt", log_csv="results/pretrain/log.csv")
PY
echo "pretrain rc=$? clgpt pretrain stage wall $(( $(date +%s) - t0 )) s" >> $OUT/clgpt.log
wait $NANO
tail -3 $OUT/clgpt.log; grep -E "step 5000|saving|wall" $OUT/nanogpt.log | tail -4
( cd .nanogpt && PYTHONPATH= python3 heldout_loss.py /tmp/nanogpt_out data/austen_char ) 2>&1 | tee $OUT/nanogpt_heldout.txt
mkdir -p $OUT/clgpt; cp results/pretrain/log.csv $OUT/clgpt/pretrain_log.csv
python3 -c "
import csv; rows = [r for r in csv.DictReader(open('results/pretrain/log.csv')) if r.get('val_loss')]
for r in rows: print(r['step'], r['val_loss'])
print('best held-out loss', min(float(r['val_loss']) for r in rows))"
