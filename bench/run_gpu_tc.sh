#!/bin/bash
# One device call for the tensor-core work (issue 15): kernel checks, GEMM vs torch, training tokens/s at M,
# 6 layers x 384 and L (clgpt bf16 / tf32 vs PyTorch torch.compile + bf16 autocast + fused AdamW, same call),
# 200-step curves fp32 / tf32 / bf16 and a bf16 rerun. Run from the repository root (carry .whl).
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 90 python3 bench/gpu_tc.py check 2>&1 | grep -v Warn | tee $O/check.txt
grep -q "check: passed" $O/check.txt || { echo "kernel check failed: stopping"; exit 1; }
timeout 80 python3 bench/gpu_tc.py gemm 2>&1 | grep -v Warn | tee $O/gemm.txt
bench() {  # shape precision
  eval args=\$$1; steps=30; [ $1 = L ] && steps=10
  echo "== $1 clgpt $2" | tee -a $O/train.txt
  timeout 60 python3 -m clgpt bench $args --steps $steps --gemm 0 --precision $2 2>&1 | grep -v "^  \|Warn" | tail -2 | tee -a $O/train.txt
}
for shape in M M6 L; do
  bench $shape bf16
  eval args=\$$shape; steps=30; [ $shape = L ] && steps=10
  echo "== $shape torch nanogpt (compile, bf16 autocast, SDPA, fused AdamW)" | tee -a $O/train.txt
  timeout 120 python3 bench/bench_torch.py $args --steps $steps --warmup 5 --device cuda --nanogpt 2>&1 | tail -2 | tee -a $O/train.txt
done
timeout 100 python3 bench/gpu_tc.py curve 2>&1 | grep -v Warn | tee $O/curve.txt
for shape in M M6 L; do bench $shape tf32; done
bench M fp32
