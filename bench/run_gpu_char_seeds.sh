#!/bin/bash
# One device call (issue 12, the CPU recipe's held-out parity): how far apart runs of nanoGPT's CPU shakespeare_char
# recipe land from seed to seed and with/without biases, beside clgpt's pretrain stage on the same recipe and seeds.
# The recipe's numerics do not depend on the device, so both run on the H200 here in fp32 (nanoGPT: --dtype=float32,
# compile off, TF32 off) to take seconds instead of minutes a run; the wall-time comparison stays on the CPU.
# nanoGPT's seed is hard-coded (torch.manual_seed(1337 + seed_offset)): a copy, train_seed.py, reads it from
# NANOGPT_SEED; that and TF32 off are its only changes. Held-out: the whole val split in consecutive 64-token windows
# for both (nanoGPT: bench/nanogpt_heldout.py on its best checkpoint; clgpt: the evaluate stage's mean_loss on its
# kept (best) checkpoint), in nats per byte.
# Needs results/encoded + results/tokenizer of configs/shakespeare_char_cpu.yaml (encode on the CPU first), text/ and
# .nanogpt/ (as bench/run_gpu_char.sh):  run(carry=[".whl", "results", ".nanogpt"], command="bash bench/run_gpu_char_seeds.sh")
SEEDS=${SEEDS:-1337 1338 1339}  # SKIP_CLGPT=1: nanoGPT's runs only
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
( cd .nanogpt
  sed -e 's/torch.manual_seed(1337 + seed_offset)/torch.manual_seed(int(os.environ.get("NANOGPT_SEED", "1337")) + seed_offset)/' \
      -e 's/allow_tf32 = True/allow_tf32 = False/' train.py > train_seed.py
  grep -q NANOGPT_SEED train_seed.py || { echo "train_seed.py: seed line not found"; exit 1; }
  for bias in False True; do for seed in $SEEDS; do
    PYTHONPATH= NANOGPT_SEED=$seed python3 train_seed.py config/train_shakespeare_char.py --device=cuda --compile=False \
      --dtype=float32 --eval_iters=20 --log_interval=100 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 \
      --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --bias=$bias --dataset=austen_char \
      --out_dir=/tmp/ng_${bias}_${seed} > $OUT/nanogpt_bias${bias}_seed${seed}.log 2>&1 &
  done; done; wait
  for bias in False True; do for seed in $SEEDS; do
    ( echo "nanogpt bias=$bias seed=$seed $(PYTHONPATH= python3 ../bench/nanogpt_heldout.py /tmp/ng_${bias}_${seed} data/austen_char 2>&1 | tail -1)" \
        > /tmp/ng_heldout_${bias}_${seed}.txt ) &
  done; done; wait
  cat /tmp/ng_heldout_*.txt > $OUT/nanogpt_heldout.txt ) &
NANO=$!
for seed in $SEEDS; do
  [ -n "$SKIP_CLGPT" ] && break
  timeout 300 python3 "$(dirname "$0")/clgpt_char_seed.py" $seed > $OUT/clgpt_seed$seed.log 2>&1
  tail -1 $OUT/clgpt_seed$seed.log
done | tee $OUT/clgpt_heldout.txt
wait $NANO
cat $OUT/nanogpt_heldout.txt
grep -h "step 2000" $OUT/nanogpt_bias*.log | head -6
