#!/bin/bash
# One device call for the bf16 GEMM rewrite (issue 15, kernels/matmul_bf16.cl): GEMM variants vs torch.matmul
# bf16 (bench/gemm_tc.py), the tensor-core checks (bench/gpu_tc.py check), training tokens/s at M, M6 and L with
# clgpt bf16 (and bf16 on the previous kernel, CLGPT_BF16=off, at M6) vs PyTorch torch.compile + bf16 autocast +
# fused AdamW in the same call, and a per-kernel profile of M6. From the repository root: bash bench/run_gpu_gemm.sh (carry .whl)
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${GEMM_S:-200} python3 bench/gemm_tc.py $GEMM_ARGS 2>&1 | grep -v Warn | tee $O/gemm_tc.txt
timeout 90 python3 bench/gpu_tc.py check 2>&1 | grep -v Warn | tee $O/check.txt
grep -q "check: passed" $O/check.txt || { echo "kernel check failed: stopping"; exit 1; }
# train with the tiles bench/gemm_tc.py found fastest over all shapes (unless CLGPT_BF16 is given)
[ -z "$CLGPT_BF16" ] && [ -s $O/best_bf16.txt ] && export CLGPT_BF16=$(cat $O/best_bf16.txt)
echo "training with CLGPT_BF16=$CLGPT_BF16" | tee -a $O/train.txt
bench() {  # shape precision [env]
  eval args=\$$1; steps=30; [ $1 = L ] && steps=10
  echo "== $1 clgpt $2 $3" | tee -a $O/train.txt
  env $3 timeout 60 python3 -m clgpt bench $args --steps $steps --gemm 0 --precision $2 2>&1 | grep -v "^  \|Warn" | tail -2 | tee -a $O/train.txt
}
for shape in ${SHAPES:-M6 L M}; do
  bench $shape bf16
  eval args=\$$shape; steps=30; [ $shape = L ] && steps=10
  echo "== $shape torch nanogpt (compile, bf16 autocast, SDPA, fused AdamW)" | tee -a $O/train.txt
  timeout 120 python3 bench/bench_torch.py $args --steps $steps --warmup 5 --device cuda --nanogpt 2>&1 | tail -2 | tee -a $O/train.txt
done
[ -n "$OLD" ] && bench M6 bf16 CLGPT_BF16=off
for shape in $PROFILE; do
  eval args=\$$shape
  echo "== profile $shape bf16" | tee -a $O/profile.txt
  CLGPT_BENCH_PROFILE=1 timeout 60 python3 -m clgpt bench $args --steps 2 --gemm 0 --precision bf16 2>&1 | grep -A24 "^profile" | tee -a $O/profile.txt
done
[ -n "$CURVE" ] && timeout 40 python3 bench/gpu_tc.py curve 2>&1 | grep -v Warn | tee $O/curve.txt
exit 0
