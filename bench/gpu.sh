#!/bin/bash
# The device calls on an NVIDIA GPU, one subcommand each, from the repository root of the device machine (carry .whl):
#   bash bench/gpu.sh SUBCOMMAND [ARG]        e.g.  SHAPES="M6 L M" bash bench/gpu.sh flash
# `bash bench/gpu.sh` lists the subcommands. Each one sources bench/gpu_env.sh (the carried wheels, NVIDIA's OpenCL,
# the bench shapes, the clgpt / PyTorch / profile helpers), prints the GPU's line and writes its files under OUT
# (default /tmp/out). Its settings come from the environment and are named above its function (SHAPES, REPS, ...).
# GPU_SH_DRY=1: print the function a subcommand reaches and its arguments, then stop; nothing is sourced or run
# (checks the dispatch off the device: tests/test_bench_scripts.py).
HERE=$(dirname "$0")

usage() {
  cat >&2 <<'EOF'
usage: bash bench/gpu.sh SUBCOMMAND [ARG]   (settings from the environment; files under OUT, default /tmp/out)
  suite [full|bench|quick]  NVIDIA OpenCL tests, GEMM sweep, fp32 training S/M/L vs PyTorch eager, profiles, pipeline
  ratio        clgpt bf16 vs PyTorch torch.compile, alternated per shape; SHAPES (M6 L M), REPS (3), BASE, NOWARM
  peer         clgpt bf16 vs the PyTorch peer compiled once a shape, alternated, and the peer's minimal-loop check
  flash        bench/flash_check.py, then bf16 training with flash attention on and off vs PyTorch; SHAPES, PROFILE
  arch         gpt2, llama and MoE in fp32 vs PyTorch eager at M and G; EQUAL_PARAMS=1, PROFILE=1
  tc           tensor-core checks, GEMM vs torch, bf16 / tf32 / fp32 training vs PyTorch, 200-step curves
  wgmma        wgmma checks and GEMM, bf16 training with wgmma on and off vs PyTorch, curves; TRAIN_ONLY=1
  char         nanoGPT's character GPU recipe beside the pretrain stage, same time: held-out loss
  char-speed   the same recipe timed whole, nanoGPT's train.py then the pretrain stage; PRECISION (bf16)
  char-vocab   the character CPU recipe's held-out loss by vocabulary size, nanoGPT vs clgpt, fp32; SEEDS, FINAL=1
  muon         Muon's step cost, then AdamW against Muon on the char GPU recipe; SEEDS (3), BUDGET (420 s), MUON_LR
  mpi [one]    1 vs 2 GPUs over MPI at S6 and L (nvidia-h200-x2); one: both ranks share one GPU
  generic      the generic GPU row (CLGPT_LAUNCH=gpu) with the device tuner vs PyTorch eager fp32, GEMM vs cuBLAS
  flash-portable  bench/flash_portable.py: portable flash attention vs the batched form and SDPA fp32; SHAPES, REPS
  gemm-forms   the portable GEMM forms one by one (warp-tiled and tiled) vs cuBLAS at 4096^2 and the M6 / L products
  generic-bf16 the generic GPU row, tuned: fp32 against bf16 storage, training at L and the 4096^2 GEMM
  products     where a bf16 step's products stand against cuBLAS: a profile, torch.matmul on each product, ncu; SHAPE
EOF
}

# setup [all-gpus]: gpu_env.sh, PYOPENCL_CTX=0 (all-gpus: unset, so MPI rank i takes the i-th GPU), O = the output
# folder, the GPU's line into $O/gpu.txt
setup() {
  if [ -n "${GPU_SH_DRY:-}" ]; then echo "gpu.sh: ${FUNCNAME[1]}${ARGS:+ $ARGS}"; exit 0; fi
  source "$HERE/gpu_env.sh" || exit 1
  [ "${1:-}" = all-gpus ] || export PYOPENCL_CTX=0
  O=${OUT:-/tmp/out}; mkdir -p "$O"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader | tee "$O/gpu.txt"
}

# tc_check: bench/gpu_tc.py check (the tensor-core kernels against float64 and the portable ones); stops the call
# unless it passed
tc_check() {
  timeout 120 python3 bench/gpu_tc.py check 2>&1 | grep -v Warn | tee "$O/check.txt"
  grep -q "check: passed" "$O/check.txt" || { echo "kernel check failed: stopping"; exit 1; }
}

# at SHAPE [STEPS [BIG_STEPS]]: args = the `clgpt bench` arguments of SHAPE (gpu_env.sh's variable of that name),
# steps = STEPS (30), or BIG_STEPS (10) at L and the GPT-2 shapes
at() {
  eval args=\$$1
  steps=${2:-30}
  case $1 in L | GPT2*) steps=${3:-10} ;; esac
}

# pretrain_char SECONDS [PRECISION]: clgpt's pretrain stage through scripts/pretrain.py's main, with the settings the
# workflow would give it under configs/shakespeare_char_gpu.yaml (precision PRECISION if given), into results/pretrain/.
# The device has no snakemake: the tokenizer and encode stages ran beforehand on the CPU (same bytes on any device:
#   snakemake --cores 1 results/encoded/pretrain.bin results/encoded/pretrain_heldout.bin --configfile configs/shakespeare_char_gpu.yaml)
# and results/ is carried.
pretrain_char() {
  rm -rf results/pretrain
  PRECISION=${2:-} timeout "$1" python3 - <<'PY'
import os, runpy
from clgpt.config import load_workflow_config
cfg = load_workflow_config("config.yaml", configfiles=["configs/shakespeare_char_gpu.yaml"])
if os.environ["PRECISION"]:
    cfg["pretrain"]["precision"] = os.environ["PRECISION"]
main = runpy.run_path("scripts/pretrain.py")["main"]
main(encoded="results/encoded/pretrain.bin", heldout="results/encoded/pretrain_heldout.bin",
     tokenizer="results/tokenizer/tokenizer.json", model=cfg["model"], settings=cfg["pretrain"], device=cfg["device"],
     checkpoint="results/pretrain/model.ckpt", log_csv="results/pretrain/log.csv")
PY
}

# suite [full|bench|quick]: tests on NVIDIA OpenCL, GEMM sweep, fp32 training S/M/L against PyTorch CUDA eager
# (and at S and M with CLGPT_PRESET=0), profiles of M and L, then the default pipeline on this device.
# full: everything; bench: no profiles; quick: no profiles, no GEMM sweep
cmd_suite() {
  local mode=${1:-full}
  case $mode in full | bench | quick) ;; *) echo "gpu.sh suite: full, bench or quick, not '$mode'" >&2; exit 2 ;; esac
  setup
  S="--vocab 512 --ctx 80 --embd 64 --ffn 128 --heads 2 --layers 1 --batch 8"
  timeout 170 python3 -m pytest tests/test_kernels_*.py tests/test_engine.py tests/test_engine_contract.py -q -x \
    -p no:cacheprovider -W ignore 2>&1 | tail -15 | tee "$O/tests.txt"
  [ "$mode" != quick ] && timeout 60 python3 bench/gemm_sweep.py 4096 2>&1 | grep -v Warn | tee "$O/gemm.txt"
  for shape in S M L; do
    at $shape
    clgpt_train $shape "$args" $steps fp32
    [ $shape != L ] && CLGPT_PRESET=0 CLGPT_SIDE=CLGPT_PRESET=0 clgpt_train $shape "$args" $steps fp32
    torch_eager $shape "$args" $steps
  done
  if [ "$mode" = full ]; then profile M "$M" fp32; profile L "$L" fp32; fi
  rm -rf results benchmarks logs model.gguf Modelfile .snakemake
  ( time timeout 240 python3 -m snakemake --cores 4 model.gguf ) >"$O/pipeline_log.txt" 2>&1
  echo "snakemake rc=$?" | tee -a "$O/pipeline_log.txt"
  tail -5 "$O/pipeline_log.txt"
  mkdir -p "$O/pipe"
  for f in benchmarks/*.tsv; do echo "== $f"; cat "$f"; done >"$O/pipe/benchmarks.txt" 2>&1
  cp results/eval/report.md "$O/pipe/report.md" 2>/dev/null
  cat "$O/pipe/benchmarks.txt"; grep -i -m5 "exact" results/eval/report.md
}

# ratio: clgpt bf16 (defaults) and PyTorch torch.compile + bf16 autocast + SDPA + fused AdamW, alternated REPS (3)
# times per shape (PyTorch's own step time moved by up to 1.8x between calls, so each ratio pairs runs of the same
# call; report the medians). SHAPES names gpu_env.sh's variables (M6 L M); BASE, a worktree of an earlier commit
# under .wt/ (carried), adds its clgpt to each pair, to measure a change. NOWARM=1: no untimed first runs.
cmd_ratio() {
  setup
  # the first process of a call ran 10-15% slower (M6 10.0-10.3 ms against 8.85 later in the same call): one
  # untimed run of each side first
  [ -n "${NOWARM:-}" ] || (O=/tmp; clgpt_train warm-up "$M6" 20 >/dev/null; torch_peer warm-up "$M6" 20 >/dev/null)
  for rep in $(seq "${REPS:-3}"); do
    for shape in ${SHAPES:-M6 L M}; do
      at $shape 50 20
      if [ -n "${BASE:-}" ]; then
        (cd "$BASE" && PYTHONPATH=/tmp/site:$PWD CLGPT_SIDE=base clgpt_train "rep $rep $shape" "$args" $steps)
      fi
      clgpt_train "rep $rep $shape" "$args" $steps
      torch_peer "rep $rep $shape" "$args" $steps
    done
  done
}

# peer (issue 44): clgpt bf16 against the PyTorch peer as nanoGPT users run it (torch.compile, bf16 autocast, SDPA,
# fused AdamW, batches resident on the device, zero_grad(set_to_none=True)) through bench/peer_ratio.py: each shape's
# peer compiles once (while clgpt's first, untimed runs build its kernels), then REPS (2) pairs a shape, clgpt then
# the waiting peer; at CHECK (CHAR_L GPT2S) the peer against a minimal nanoGPT-style loop in its own process. SHAPES
# (CHAR CHAR_L CHAR_MOE L GPT2S GPT2S_L GPT2M GPT2M_L), steps as `at` gives (100; 30 at L and the GPT-2 shapes). The
# table goes to $O/peer_table.md, each peer's output to $O/torch_SHAPE.log. Within 9 minutes on an H100: a peer not
# compiled 240 s in is dropped (clgpt runs alone there), no shape starts after 420 s (the table lists those left).
cmd_peer() {
  setup
  local a=() c=()
  for shape in ${SHAPES:-CHAR CHAR_L CHAR_MOE L GPT2S GPT2S_L GPT2M GPT2M_L}; do at $shape 100 30; a+=(--shape $shape $steps "$args"); done
  for shape in ${CHECK:-CHAR_L GPT2S}; do c+=(--check $shape); done
  timeout 510 python3 bench/peer_ratio.py "${a[@]}" "${c[@]}" --reps "${REPS:-2}" --compile-limit 240 --budget 420 \
    --out "$O" 2>&1 | grep -v "Warn\|lambda" | tee "$O/peer.txt"
}

# flash: the tensor-core checks and bench/flash_check.py (the kernels against float64, attention forward + backward
# against the batched form and PyTorch's SDPA), then training in bf16 with flash attention and without
# (--attention batched) beside PyTorch torch.compile + bf16 autocast + SDPA + fused AdamW at SHAPES (M6 L M);
# PROFILE="M6 L": then per-kernel device times of those shapes
cmd_flash() {
  setup
  tc_check
  CLGPT_NV_VERBOSE=1 PYOPENCL_COMPILER_OUTPUT=1 timeout 150 python3 bench/flash_check.py 2>&1 \
    | grep -v "Warn\|lambda\|^$" | grep -i "flash\|check\|ms\|registers\|spill\|error" | tee "$O/flash.txt"
  grep -q "flash check: passed" "$O/flash.txt" || { echo "flash check failed: stopping"; exit 1; }
  for shape in ${SHAPES:-M6 L M}; do
    at $shape
    for f in flash batched; do clgpt_train "$shape attention $f" "$args --attention $f" $steps; done
    torch_peer $shape "$args" $steps
  done
  profile_bf16 ${PROFILE:-}
}

# arch: a few NVIDIA OpenCL correctness tests, then llama vs gpt2 and MoE (4 experts, top-2) vs dense llama in fp32,
# each against its PyTorch CUDA eager peer (SDPA, fused AdamW), at M and G (the nanoGPT GPU recipe's shape: 6 layers,
# 384 channels, batch 64, context 256, byte vocabulary).
# EQUAL_PARAMS=1: also llama at its usual width, n_ff = 2/3 of gpt2's up to a multiple of 32 (M 704, G 1024; what
# model.n_ff 0 picks, clgpt.model.usual_n_ff): its three FFN matrices then hold what gpt2's two do, so the two models
# have (nearly) the same parameters and matmul FLOPs.
# PROFILE=1: then per-kernel device times of MoE at M and G and of dense llama at G.
cmd_arch() {
  setup
  timeout 150 python3 -m pytest tests/test_llama_engine.py tests/test_engine_contract.py tests/test_dropout.py -q -x \
    -p no:cacheprovider -W ignore -k "(not gpt2 and engine_loss_logits) or grouped or moe_kernels or with_dropout_vs_reference" 2>&1 | tail -4 | tee "$O/tests.txt"
  G=$CHAR
  local moe="--arch llama --experts 4 --experts-used 2"
  for shape in M G; do
    at $shape 20; [ $shape = G ] && steps=10
    local runs=("--arch gpt2" "--arch llama" "$moe")
    if [ -n "${EQUAL_PARAMS:-}" ]; then
      local ffn=704; [ $shape = G ] && ffn=1024
      runs+=("--arch llama --ffn $ffn" "$moe --ffn $ffn")
    fi
    for a in "${runs[@]}"; do clgpt_train "$shape $a" "$args $a" $steps fp32; done
    for a in "${runs[@]}"; do torch_eager "$shape $a" "$args $a" $steps; done
  done
  [ -n "${PROFILE:-}" ] || return 0
  for run in "M $moe" "G $moe" "G --arch llama"; do
    set -- $run; shape=$1; shift
    eval args=\$$shape
    profile "$shape $*" "$args $*" fp32
  done
}

# tc: the tensor-core checks, GEMM vs torch (bench/gpu_tc.py gemm), training at M, M6 and L in bf16 against PyTorch
# torch.compile + bf16 autocast + fused AdamW in the same call, the 200-step curves fp32 / tf32 / bf16 with a bf16
# rerun (bench/gpu_tc.py curve), then tf32 at each shape and fp32 at M
cmd_tc() {
  setup
  tc_check
  timeout 80 python3 bench/gpu_tc.py gemm 2>&1 | grep -v Warn | tee "$O/gemm.txt"
  for shape in M M6 L; do
    at $shape
    clgpt_train $shape "$args" $steps
    torch_peer $shape "$args" $steps
  done
  timeout 100 python3 bench/gpu_tc.py curve 2>&1 | grep -v Warn | tee "$O/curve.txt"
  for shape in M M6 L; do at $shape; clgpt_train $shape "$args" $steps tf32; done
  clgpt_train M "$M" 30 fp32
}

# wgmma: the tensor-core checks, the wgmma kernel alone against torch.matmul bf16 (bench/gemm_wgmma.py), the engine's
# whole products against float64 and torch with wgmma and without (CLGPT_WGMMA=off: the mma.sync kernel), then
# training at M, M6 and L in bf16 with and without wgmma beside PyTorch torch.compile + bf16 autocast + fused AdamW,
# and the 200-step curves. TRAIN_ONLY=1: the training rows alone.
cmd_wgmma() {
  setup
  if [ -z "${TRAIN_ONLY:-}" ]; then
    tc_check
    timeout 60 python3 bench/gemm_wgmma.py 2>&1 | grep -v "Warn\|lambda" | tee "$O/gemm_wgmma.txt"
    for w in on off; do
      echo "== engine products, wgmma $w" | tee -a "$O/gemm_tc.txt"
      CLGPT_WGMMA=$([ $w = off ] && echo off) GEMM_TC_CONFIGS="128,128,2,4,3" timeout 120 python3 bench/gemm_tc.py 2>&1 \
        | grep -v "Warn\|lambda\|ptxas\|^$" | grep "==\|full" | tee -a "$O/gemm_tc.txt"
    done
  fi
  for shape in M M6 L; do
    at $shape
    for w in on off; do
      CLGPT_WGMMA=$([ $w = off ] && echo off) CLGPT_SIDE="wgmma $w" clgpt_train $shape "$args" $steps
    done
    torch_peer $shape "$args" $steps
  done
  [ -n "${TRAIN_ONLY:-}" ] || timeout 100 python3 bench/gpu_tc.py curve 2>&1 | grep -v Warn | tee "$O/curve.txt"
}

# char (issue 12): nanoGPT's shakespeare_char GPU recipe (6 layers, 6 heads, 384 channels, context 256, batch 64,
# 5000 steps, lr 1e-3 -> 1e-4, dropout 0.2) beside clgpt's pretrain stage with configs/shakespeare_char_gpu.yaml, on
# the same text and the same GPU, at the same time (so their wall times here are not a speed comparison).
# Needs text/austen.txt (bench/austen_text.py), results/ from the CPU stages (pretrain_char) and .nanogpt/ (nanoGPT's
# train.py, model.py, configurator.py, config/train_shakespeare_char.py, data/austen_char/{train,val}.bin + meta.pkl
# from its prepare.py, and /work/nanogpt/heldout_loss.py), carried:
#   run(carry=[".whl", "text", ".nanogpt", "results"], command="bash bench/gpu.sh char")
cmd_char() {
  setup
  ( cd .nanogpt && t0=$(date +%s); PYTHONPATH= python3 train.py config/train_shakespeare_char.py \
      --dataset=austen_char --out_dir=/tmp/nanogpt_out >"$O/nanogpt.log" 2>&1
    echo "nanogpt wall $(( $(date +%s) - t0 )) s" >>"$O/nanogpt.log" ) &
  local nano=$! t0=$(date +%s)
  pretrain_char 520 >"$O/clgpt.log" 2>&1
  echo "pretrain rc=$? clgpt pretrain stage wall $(( $(date +%s) - t0 )) s" >>"$O/clgpt.log"
  wait $nano
  tail -3 "$O/clgpt.log"; grep -E "step 5000|saving|wall" "$O/nanogpt.log" | tail -4
  ( cd .nanogpt && PYTHONPATH= python3 heldout_loss.py /tmp/nanogpt_out data/austen_char ) 2>&1 | tee "$O/nanogpt_heldout.txt"
  mkdir -p "$O/clgpt"; cp results/pretrain/log.csv "$O/clgpt/pretrain_log.csv"
  python3 -c "
import csv; rows = [r for r in csv.DictReader(open('results/pretrain/log.csv')) if r.get('val_loss')]
for r in rows: print(r['step'], r['val_loss'])
print('best held-out loss', min(float(r['val_loss']) for r in rows))"
}

# char-speed (issue 15): nanoGPT's shakespeare_char GPU recipe (as char, evaluations every 250 steps) as nanoGPT's own
# train.py runs it (torch.compile, bf16 autocast), then clgpt's pretrain stage with configs/shakespeare_char_gpu.yaml
# at precision PRECISION (bf16 unless given), one after the other on the same GPU, each timed as a whole (compile,
# evaluations and checkpoints included). Needs what char needs, carried:
#   run(carry=[".whl", "text", ".nanogpt", "results"], command="bash bench/gpu.sh char-speed")
cmd_char_speed() {
  setup
  export PRECISION=${PRECISION:-bf16}
  ( cd .nanogpt && t0=$(date +%s.%N); PYTHONPATH= timeout 200 python3 train.py config/train_shakespeare_char.py \
      --dataset=austen_char --out_dir=/tmp/nanogpt_out >"$O/nanogpt.log" 2>&1
    echo "nanogpt train.py rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a "$O/nanogpt.log" )
  local t0=$(date +%s.%N)
  pretrain_char 230 "$PRECISION" >"$O/clgpt.log" 2>&1
  echo "clgpt pretrain stage ($PRECISION) rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a "$O/clgpt.log"
  grep -E "step (2000|5000):" "$O/nanogpt.log" | tail -2
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
  grep -E "^iter (100|1000|2000|3000|4000|4900):" "$O/nanogpt.log"
  cp results/pretrain/log.csv "$O/clgpt_log.csv"
}

# char-vocab (issue 12): why clgpt without biases lands below nanoGPT's bias=False on the character CPU recipe. The
# suspect is the vocabulary: clgpt's byte tokenizer has 260 rows (tied embedding and head, 183 of them never seen)
# where nanoGPT's char dataset has 77. The recipe's numerics do not depend on the device, so all runs go on the GPU in
# fp32 (nanoGPT: --dtype=float32, compile off, TF32 off), in parallel, each scored on the whole val split in
# consecutive 64-token windows (nanoGPT: bench/nanogpt_heldout.py on its best checkpoint; clgpt:
# bench/clgpt_char_seed.py, the evaluate stage's mean_loss on its kept checkpoint), in nats per byte:
#   ng77      nanoGPT bias=False at its own 77-entry vocabulary (the reference figure)
#   ng260     nanoGPT bias=False with meta.pkl's vocab_size padded to 260 (ids unchanged: rows 77..259 unused)
#   ng77b     nanoGPT bias=True at 77 (none unless NG77B names seeds)
#   ng260b    nanoGPT bias=True at 260 (does the padding move the bias=True figure too?)
#   ng77tanh  nanoGPT bias=False at 77 with clgpt's GELU (tanh form) instead of nn.GELU's erf form
#   clgpt     clgpt's pretrain stage, configs/shakespeare_char_cpu.yaml as it is (bias: false)
# nanoGPT's seed is hard-coded (torch.manual_seed(1337 + seed_offset)): its copies read it from NANOGPT_SEED; that and
# TF32 off are their only changes. Needs results/encoded + results/tokenizer of configs/shakespeare_char_cpu.yaml
# (encode on the CPU first) and .nanogpt/ (as char). Run from the repository root or from a worktree under .wt/
# (results/ and .nanogpt/ are then two folders up):
#   run(carry=[".whl", "results", ".nanogpt", ".wt/natsgap"], command="cd .wt/natsgap && bash bench/gpu.sh char-vocab")
# Seeds per group: NG77, NG260, CLGPT (SEEDS: 1337 1338 1339), NG260B, NG77TANH (SEEDS2: 1337 1338), NG77B (none);
# FINAL=1 scores the step-2000 weights of every run instead of the best evaluation's (nanoGPT
# --always_save_checkpoint=True, clgpt keep: last), taking checkpoint choice out of it.
cmd_char_vocab() {
  setup
  SEEDS=${SEEDS:-1337 1338 1339}
  SEEDS2=${SEEDS2:-1337 1338}
  NG77=${NG77-$SEEDS} NG260=${NG260-$SEEDS} CLGPT=${CLGPT-$SEEDS} NG260B=${NG260B-$SEEDS2} NG77TANH=${NG77TANH-$SEEDS2}
  NG77B=${NG77B-}
  KEEP=best SAVE_ALL=False; [ -n "${FINAL:-}" ] && KEEP=last SAVE_ALL=True
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
  # two copies of nanoGPT: as it is (seed from NANOGPT_SEED, TF32 off) and with GELU tanh
  for v in base tanh; do
    mkdir -p /tmp/ng_$v && cp -r $NG/model.py $NG/configurator.py $NG/config /tmp/ng_$v/ && ln -sfn /tmp/ngdata /tmp/ng_$v/data
    sed -e 's/torch.manual_seed(1337 + seed_offset)/torch.manual_seed(int(os.environ.get("NANOGPT_SEED", "1337")) + seed_offset)/' \
        -e 's/allow_tf32 = True/allow_tf32 = False/' $NG/train.py >/tmp/ng_$v/train.py
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
        --bias=$4 --dataset=$3 --always_save_checkpoint=$SAVE_ALL --out_dir=$out >/tmp/logs/$1_seed$5.log 2>&1
      echo "$1 seed=$5 $(PYTHONPATH= python3 $HELDOUT $out data/$3 2>&1 | tail -1)" >/tmp/heldout_$1_$5.txt )
  }
  for seed in $NG77; do nanogpt ng77 base austen_char False $seed & done
  for seed in $NG260; do nanogpt ng260 base austen_char260 False $seed & done
  for seed in $NG77B; do nanogpt ng77b base austen_char True $seed & done
  for seed in $NG260B; do nanogpt ng260b base austen_char260 True $seed & done
  for seed in $NG77TANH; do nanogpt ng77tanh tanh austen_char False $seed & done
  for seed in $CLGPT; do
    mkdir -p /tmp/clgpt_$seed
    timeout 330 python3 "$HERE/clgpt_char_seed.py" $seed $RES $KEEP >/tmp/logs/clgpt_seed$seed.log 2>&1 &
  done
  wait
  for seed in $CLGPT; do tail -1 /tmp/logs/clgpt_seed$seed.log; done | tee "$O/clgpt_heldout.txt"
  cat /tmp/heldout_*.txt | sort | tee "$O/nanogpt_heldout.txt"
  for f in /tmp/logs/*.log; do echo "== $f"; tail -25 $f; done >"$O/logs.txt"  # 3 files come back in all
  grep -H "step 2000" /tmp/logs/ng*_seed*.log 2>/dev/null
  python3 - "$O/nanogpt_heldout.txt" "$O/clgpt_heldout.txt" <<'PY'
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
}

# muon: AdamW against Muon on nanoGPT's character GPU recipe (configs/shakespeare_char_gpu.yaml, the rest unchanged).
# First the step's cost: bench/muon_step.py, Newton-Schulz on the device against float64 (--check), a training
# step and the optimizer's part alone, AdamW and Muon in PAIRS (3) alternated pairs, the launches of each optimizer
# step and its kernels' device times on a profiling queue (--profile) ($O/muon_step.txt, .json). Then
# bench/muon_vs_adamw.py: the kernel cache warmed, then SEEDS seeds each (3) from FIRST_SEED (the recipe's), Muon's
# learning rate MUON_LR (0.012, this recipe's best of those tried), alternated, held-out loss every
# EVAL_EVERY steps (250), precision PRECISION (auto: bf16 on tensor cores), no pair started that would end past
# BUDGET seconds (420: with the step bench the call stays near 8 minutes; a pair is 3-4 minutes), its CSV, plot and
# summary (the time Muon needs to reach AdamW's best held-out loss, over AdamW's) under $O/muon. Seeds left out go in
# a later call (SEEDS=1 FIRST_SEED=1339 STEP=0), then `python bench/muon_vs_adamw.py --summarize */runs.csv`.
# STEP=0 skips the step bench. The device has no snakemake: the encoded corpus is made on the CPU beforehand
# (text/austen.txt from bench/austen_text.py) and carried:
#   snakemake --cores 1 results/encoded/pretrain.bin results/encoded/pretrain_heldout.bin \
#     results/tokenizer/tokenizer.json --configfile configs/shakespeare_char_gpu.yaml
#   run(carry=[".whl", "results/encoded", "results/tokenizer"], command="bash bench/gpu.sh muon")
cmd_muon() {
  setup
  if [ "${STEP:-1}" != 0 ]; then
    timeout 150 python3 bench/muon_step.py --configfile configs/shakespeare_char_gpu.yaml --pairs "${PAIRS:-3}" \
      --precision "${PRECISION:-auto}" --check --profile --json "$O/muon_step.json" 2>"$O/muon_step.log" \
      | tee "$O/muon_step.txt"
  fi
  python3 bench/muon_vs_adamw.py --configfile configs/shakespeare_char_gpu.yaml --seeds "${SEEDS:-3}" --warm \
    --first-seed "${FIRST_SEED:--1}" --eval-every "${EVAL_EVERY:-250}" --precision "${PRECISION:-auto}" \
    --muon-lr "${MUON_LR:-0.012}" \
    --budget-s "${BUDGET:-420}" --out "$O/muon" 2>"$O/muon.log" | tee "$O/muon.txt"
}

# mpi [one] (issue 16), on nvidia-h200-x2: 1 GPU vs 2 GPUs over MPI at S6 and L (bench/bench_mpi.py), the loss
# curve, the breakdown. one (when nvidia-h200-x2 is not lent): both ranks share one GPU; the 1-rank timings, the
# copies and the host-side sums are still what two GPUs would see, the 2-rank step times are not.
cmd_mpi() {
  case ${1:-} in "" | one) ;; *) echo "gpu.sh mpi: one or nothing, not '$1'" >&2; exit 2 ;; esac
  setup all-gpus
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  python3 -c "import mpi4py, mpi4py.MPI as M; print('mpi4py', mpi4py.__version__, M.Get_library_version().splitlines()[0])"
  set -o pipefail
  if [ "${1:-}" = one ]; then
    timeout 120 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape S6 --accum 4 --steps 3 --warmup 1 \
      --curve 40 --json "$O/s6.json" 2>&1 | grep -v Warn | tee "$O/s6.txt"
    timeout 120 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape L --accum 4 --steps 2 --warmup 1 \
      --json "$O/l.json" 2>&1 | grep -v Warn | tee "$O/l.txt"
    return
  fi
  timeout 170 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape S6 --accum 1 --accum 4 --steps 5 \
    --warmup 2 --curve 40 --json "$O/s6.json" 2>&1 | grep -v Warn | tee "$O/s6.txt"
  timeout 170 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape L --accum 4 --accum 8 --steps 4 \
    --warmup 1 --json "$O/l.json" 2>&1 | grep -v Warn | tee "$O/l.txt"
}

# generic: bench/generic_gpu.py (issue 43): the tuner's first run at M6 and L, fp32 training with its tiles against
# PyTorch CUDA eager fp32 and the untuned generic row, the 4096^2 GEMM against torch.matmul (TF32 off); about 6
# minutes. REPS (2) alternated rounds, SHAPES (M6 L).
cmd_generic() {
  setup
  timeout 560 python3 bench/generic_gpu.py --shapes ${SHAPES:-M6 L} --reps ${REPS:-2} 2>&1 | grep -v Warn \
    | tee "$O/generic.txt"
}

# flash-portable: bench/flash_portable.py (issue 43): portable flash attention's tuner at L and S (GPT-2 small), its
# kernels against float64, then attention forward + backward at fp32 against the batched form and PyTorch's SDPA
# (TF32 off), alternated; about 2 minutes. SHAPES (L S), REPS (10) calls a round.
cmd_flash_portable() {
  setup
  timeout 500 python3 bench/flash_portable.py --shapes ${SHAPES:-L S} --reps ${REPS:-10} 2>&1 | grep -v Warn \
    | tee "$O/flash_portable.txt"
}

# gemm-forms: bench/gemm_forms.py (issue 43): each portable GEMM form (kernels/matmul_warp.cl's warp-tiled candidates,
# the tiled ones the tuner picked before, the generic and NVIDIA rows) checked against float64, then timed against
# torch.matmul fp32 (TF32 off) at 4096^2 and at every product of an M6 and an L training step, alternated by rounds;
# about 2 minutes. REPS (3), SHAPES (M6 L), FORMS (warp; all: every candidate that fits).
cmd_gemm_forms() {
  setup
  timeout 500 python3 bench/gemm_forms.py --shapes ${SHAPES:-M6 L} --reps ${REPS:-3} --forms ${FORMS:-warp} 2>&1 \
    | grep -v Warn | tee "$O/gemm_forms.txt"
}

# generic-bf16: bench/generic_gpu.py --bf16 (issue 43): the generic row, tuned, fp32 against bf16 storage
# (kernels/matmul.cl A16, B16) in training at L and in the 4096^2 GEMM, alternated; about 4 minutes. REPS (3),
# SHAPES (L).
cmd_generic_bf16() {
  setup
  timeout 560 python3 bench/generic_gpu.py --bf16 --shapes ${SHAPES:-L} --reps ${REPS:-3} 2>&1 | grep -v Warn \
    | tee "$O/generic_bf16.txt"
}

# products: where the wgmma products of a bf16 step stand against cuBLAS (issue 44): a per-kernel profile at SHAPE
# (GPT2S), bench/gemm_products.py (torch.matmul on each product's shape and layout), then Nsight Compute over
# bench/wgmma_cuda.py (the kernel's PTX launched through CUDA) on NCU_SHAPES (its shallow products), where ncu is
# installed: throughput of the L2 and memory, warp stalls, occupancy. About 3 minutes on an H100.
cmd_products() {
  setup
  local shape=${SHAPE:-GPT2S}
  eval local args=\$$shape
  CLGPT_BENCH_PROFILE=1 timeout 150 python3 -m clgpt bench $args --steps 3 --gemm 0 --precision bf16 \
    >"$O/profile_$shape.txt" 2>&1
  grep -A40 "^profile" "$O/profile_$shape.txt"
  timeout 90 python3 bench/gemm_products.py "$O/profile_$shape.txt" 2>&1 | tee "$O/products_$shape.txt"
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "products: no ncu on this machine"; return; }
  REPS=1 WGMMA_CUDA_SHAPES="${NCU_SHAPES:-GPT2S proj,GPT2S fc}" timeout 200 "$ncu" --clock-control none \
    -k regex:matmul_wgmma --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy python3 bench/wgmma_cuda.py >"$O/ncu_products.txt" 2>&1
  grep -E "us a launch|equals|Duration|Throughput|Hit Rate|Stall|Occupancy" "$O/ncu_products.txt" | head -80
}

sub=${1:-}
fn=cmd_${sub//-/_}
if [ -z "$sub" ] || [[ $sub == *_* ]] || ! declare -F "$fn" >/dev/null; then
  [ -n "$sub" ] && echo "gpu.sh: no subcommand '$sub'" >&2
  usage
  exit 2
fi
shift
ARGS="$*"
"$fn" "$@"
