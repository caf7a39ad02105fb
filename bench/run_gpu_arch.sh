#!/bin/bash
# One device call: llama vs gpt2, MoE (4 experts, top-2) vs dense llama, and each against its PyTorch CUDA
# peer (SDPA, fused AdamW, eager fp32), at M and at the nanoGPT GPU recipe's shape (6 layers, 384 channels,
# batch 64, context 256, byte vocabulary), all in the same call; a few NVIDIA OpenCL correctness tests first.
# EQUAL_PARAMS=1: also llama at its usual width, n_ff = 2/3 of gpt2's up to a multiple of 32 (M 704, G 1024;
# what model.n_ff 0 picks, clgpt.model.usual_n_ff): its three FFN matrices then hold what gpt2's two do, so the
# two models have (nearly) the same parameters and matmul FLOPs.
# PROFILE=1: then per-kernel device times (CLGPT_BENCH_PROFILE) of MoE at M and G and of dense llama at G.
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/train.txt
timeout 150 python3 -m pytest tests/test_llama_engine.py tests/test_dropout.py -q -x -p no:cacheprovider -W ignore \
  -k "engine_loss_logits or grouped or moe_kernels or with_dropout_vs_reference" 2>&1 | tail -4 | tee $OUT/tests.txt
G="--vocab 260 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64"
MOE="--arch llama --experts 4 --experts-used 2"
for shape in M G; do
  eval args=\$$shape
  steps=20; [ $shape = G ] && steps=10
  runs=("--arch gpt2" "--arch llama" "$MOE")
  if [ -n "$EQUAL_PARAMS" ]; then ffn=704; [ $shape = G ] && ffn=1024; runs+=("--arch llama --ffn $ffn" "$MOE --ffn $ffn"); fi
  for a in "${runs[@]}"; do
    echo "== $shape clgpt $a" | tee -a $OUT/train.txt
    timeout 60 python3 -m clgpt bench $args $a --steps $steps --gemm 0 2>&1 | grep "train:" | tee -a $OUT/train.txt
  done
  for a in "${runs[@]}"; do
    echo "== $shape torch cuda $a" | tee -a $OUT/train.txt
    timeout 60 python3 bench/bench_torch.py $args $a --steps $steps --device cuda 2>&1 | grep "train:" | tee -a $OUT/train.txt
  done
done
[ -n "$PROFILE" ] || exit 0
for run in "M $MOE" "G $MOE" "G --arch llama"; do
  set -- $run; shape=$1; shift
  eval args=\$$shape
  echo "== profile $shape $*" | tee -a $OUT/profile.txt
  CLGPT_BENCH_PROFILE=1 timeout 90 python3 -m clgpt bench $args "$@" --steps 3 --gemm 0 2>&1 | grep -A40 "^profile" | tee -a $OUT/profile.txt
done
