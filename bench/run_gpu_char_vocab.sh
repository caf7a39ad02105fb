#!/bin/bash
# One device call (issue 12, round 5): why clgpt without biases lands 0.0185 nats/byte below nanoGPT's bias=False
# on the character CPU recipe. The suspect is the vocabulary: clgpt's byte tokenizer has 260 rows (tied embedding
# and head, 183 of them never seen) where nanoGPT's char dataset has 77. So, all on the H200 in fp32 as
# bench/run_gpu_char_seeds.sh (same recipe flags, same held-out scoring by bench/nanogpt_heldout.py), in parallel:
#   ng77      nanoGPT bias=False at its own 77-entry vocabulary (the reference figure again)
#   ng260     nanoGPT bias=False with meta.pkl's vocab_size padded to 260 (ids unchanged: rows 77..259 unused)
#   ng260b    nanoGPT bias=True at 260 (does the padding move the bias=True figure too?)
#   ng77tanh  nanoGPT bias=False at 77 with clgpt's GELU (tanh form) instead of nn.GELU's erf form
#   clgpt     clgpt's pretrain stage, configs/shakespeare_char_cpu.yaml as it is (bias: false)
# Run from the repository root or from a worktree under .wt/ (results/ and .nanogpt/ are then two folders up):
#   run(carry=[".whl", "results", ".nanogpt", ".wt/natsgap"],
#       command="cd .wt/natsgap && bash bench/run_gpu_char_vocab.sh")
# Seeds per group (defaults: the first call); FINAL=1 scores the step-2000 weights of every run instead of the best
# evaluation's (nanoGPT --always_save_checkpoint=True, clgpt keep: last), taking checkpoint choice out of it.
SEEDS=${SEEDS:-1337 1338 1339}
SEEDS2=${SEEDS2:-1337 1338}
NG77=${NG77-$SEEDS} NG260=${NG260-$SEEDS} CLGPT=${CLGPT-$SEEDS} NG260B=${NG260B-$SEEDS2} NG77TANH=${NG77TANH-$SEEDS2}
NG77B=${NG77B-}  # ng77b: nanoGPT bias=True at 77 (run_gpu_char_seeds.sh's bias=True row)
KEEP=best SAVE_ALL=False; [ -n "$FINAL" ] && KEEP=last SAVE_ALL=True
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
RES=results; [ -d $RES ] || RES=../../results
NG=$(cd .nanogpt 2>/dev/null || cd ../../.nanogpt; pwd)
HELDOUT=$PWD/bench/nanogpt_heldout.py
# the data: austen_char as prepared, and austen_char260 = the same train.bin/val.bin with vocab_size 260 in meta.pkl
mkdir -p /tmp/ngdata/austen_char260
ln -sfn $NG/data/austen_char /tmp/ngdata/austen_char
ln -sf $NG/data/austen_char/train.bin $NG/data/austen_char/val.bin /tmp/ngdata/austen_char260/
python3 - $NG/data/austen_char/meta.pkl /tmp/ngdata/austen_char260/meta.pkl <<'PY' || exit 1
import pickle, sys
meta = pickle.load(open(sys.argv[1], "rb"))
assert meta["vocab_size"] == len(meta["itos"]) < 260
pickle.dump(dict(meta, vocab_size=260), open(sys.argv[2], "wb"))
print(f"austen_char260: vocab_size {meta['vocab_size']} -> 260, ids unchanged")
PY
# two copies of nanoGPT: as it is (seed from NANOGPT_SEED, TF32 off: as run_gpu_char_seeds.sh) and with GELU tanh
for v in base tanh; do
  mkdir -p /tmp/ng_$v && cp -r $NG/model.py $NG/configurator.py $NG/config /tmp/ng_$v/ && ln -sfn /tmp/ngdata /tmp/ng_$v/data
  sed -e 's/torch.manual_seed(1337 + seed_offset)/torch.manual_seed(int(os.environ.get("NANOGPT_SEED", "1337")) + seed_offset)/' \
      -e 's/allow_tf32 = True/allow_tf32 = False/' $NG/train.py > /tmp/ng_$v/train.py
  grep -q NANOGPT_SEED /tmp/ng_$v/train.py || { echo "train.py: seed line not found"; exit 1; }
done
sed -i 's/nn.GELU()/nn.GELU(approximate="tanh")/' /tmp/ng_tanh/model.py
grep -q 'approximate="tanh"' /tmp/ng_tanh/model.py || { echo "model.py: GELU line not found"; exit 1; }
mkdir -p /tmp/logs
nanogpt() {  # NAME COPY DATASET BIAS SEED: train, then score the best checkpoint on the whole val split
  local out=/tmp/out_$1_$5
  ( cd /tmp/ng_$2 && PYTHONPATH= NANOGPT_SEED=$5 timeout 330 python3 train.py config/train_shakespeare_char.py \
      --device=cuda --compile=False --dtype=float32 --eval_iters=20 --log_interval=100 --block_size=64 \
      --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 \
      --bias=$4 --dataset=$3 --always_save_checkpoint=$SAVE_ALL --out_dir=$out > /tmp/logs/$1_seed$5.log 2>&1
    echo "$1 seed=$5 $(PYTHONPATH= python3 $HELDOUT $out data/$3 2>&1 | tail -1)" > /tmp/heldout_$1_$5.txt )
}
for seed in $NG77; do nanogpt ng77 base austen_char False $seed & done
for seed in $NG260; do nanogpt ng260 base austen_char260 False $seed & done
for seed in $NG77B; do nanogpt ng77b base austen_char True $seed & done
for seed in $NG260B; do nanogpt ng260b base austen_char260 True $seed & done
for seed in $NG77TANH; do nanogpt ng77tanh tanh austen_char False $seed & done
for seed in $CLGPT; do
  mkdir -p /tmp/clgpt_$seed
  timeout 330 python3 "$(dirname "$0")/clgpt_char_seed.py" $seed $RES $KEEP > /tmp/logs/clgpt_seed$seed.log 2>&1 &
done
wait
for seed in $CLGPT; do tail -1 /tmp/logs/clgpt_seed$seed.log; done | tee $OUT/clgpt_heldout.txt
cat /tmp/heldout_*.txt | sort | tee $OUT/nanogpt_heldout.txt
for f in /tmp/logs/*.log; do echo "== $f"; tail -25 $f; done > $OUT/logs.txt  # 3 files come back in all
grep -H "step 2000" /tmp/logs/ng*_seed*.log 2>/dev/null
python3 - $OUT/nanogpt_heldout.txt $OUT/clgpt_heldout.txt <<'PY'
import re, sys, collections
runs = collections.defaultdict(list)
for f in sys.argv[1:]:
    for line in open(f):
        m = re.search(r"^(\S+) seed=\d+ .* ([\d.]+) nats/byte", line)
        if m:
            runs[m.group(1)].append(float(m.group(2)))
for name, v in runs.items():
    print(f"{name:9s} " + " ".join(f"{x:.4f}" for x in v) + f"   mean {sum(v) / len(v):.4f}")
PY
