#!/bin/bash
# One device call for the wgmma GEMM (issue 15): the NVIDIA bf16 checks, the kernel alone against torch.matmul
# bf16 (bench/gemm_wgmma.py), the engine's whole products against float64 and torch with wgmma and without
# (CLGPT_WGMMA=off: the mma.sync kernel), then training at M, M6 and L in bf16 with and without wgmma beside
# PyTorch torch.compile + bf16 autocast + fused AdamW, and the 200-step curves. From the repository root
# (carry .whl). TRAIN_ONLY=1: the training rows alone.
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -z "$TRAIN_ONLY" ]; then
timeout 90 python3 bench/gpu_tc.py check 2>&1 | grep -v Warn | tee $O/check.txt
grep -q "check: passed" $O/check.txt || { echo "kernel check failed: stopping"; exit 1; }
timeout 60 python3 bench/gemm_wgmma.py 2>&1 | grep -v "Warn\|lambda" | tee $O/gemm_wgmma.txt
for w in on off; do
  echo "== engine products, wgmma $w" | tee -a $O/gemm_tc.txt
  CLGPT_WGMMA=$([ $w = off ] && echo off) GEMM_TC_CONFIGS="128,128,2,4,3" timeout 120 python3 bench/gemm_tc.py 2>&1 \
    | grep -v "Warn\|lambda\|ptxas\|^$" | grep "==\|full" | tee -a $O/gemm_tc.txt
done
fi
for shape in M M6 L; do
  eval args=\$$shape; steps=30; [ $shape = L ] && steps=10
  for w in on off; do
    echo "== $shape clgpt bf16 wgmma $w" | tee -a $O/train.txt
    CLGPT_WGMMA=$([ $w = off ] && echo off) timeout 60 python3 -m clgpt bench $args --steps $steps --gemm 0 \
      --precision bf16 2>&1 | grep "train:" | tee -a $O/train.txt
  done
  echo "== $shape torch nanogpt (compile, bf16 autocast, SDPA, fused AdamW)" | tee -a $O/train.txt
  timeout 120 python3 bench/bench_torch.py $args --steps $steps --warmup 5 --device cuda --nanogpt 2>&1 | grep "train:" | tee -a $O/train.txt
done
[ -n "$TRAIN_ONLY" ] || timeout 100 python3 bench/gpu_tc.py curve 2>&1 | grep -v Warn | tee $O/curve.txt
