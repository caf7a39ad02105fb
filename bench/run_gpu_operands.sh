#!/bin/bash
# One device call for the wgmma operand copies (issue 15): bench/gpu_tc.py check (every bf16 product on wgmma,
# K-major and M- / N-major operands, against float64 and the portable kernels), then training at M6 and L in bf16:
# the transposing copies of each product (CLGPT_WGMMA_MN=0) with round 8's size threshold and GELU' product on
# mma.sync, against one tiled copy a matrix kept across products (GELU' on mma.sync; the default, GELU' deferred
# into the gradient's copy; GELU' in the wgmma epilogue); beside PyTorch
# torch.compile + bf16 autocast + SDPA + fused AdamW. From the repository root (carry .whl).
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python3 bench/gpu_tc.py check 2>&1 | grep -v Warn | grep "bf16\|check" | tee $O/check.txt
grep -q "check: passed" $O/check.txt || { echo "check failed: stopping"; exit 1; }
M6="--vocab 4096 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64"
L="--vocab 8192 --ctx 512 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 16"
VARIANTS=("CLGPT_WGMMA_MN=0 CLGPT_WGMMA_EPI2=mma CLGPT_WGMMA_MIN_MNK=4294967296" "CLGPT_WGMMA_EPI2=mma" "" "CLGPT_WGMMA_EPI2=wgmma")
for shape in ${SHAPES:-M6 L}; do
  eval args=\$$shape; steps=30; [ $shape = L ] && steps=10
  for v in "${VARIANTS[@]}"; do
    echo "== $shape clgpt bf16 ${v:-default}" | tee -a $O/train.txt
    env $v timeout 60 python3 -m clgpt bench $args --steps $steps --gemm 0 --precision bf16 2>&1 | grep "train:\|memory" | tee -a $O/train.txt
  done
  echo "== $shape torch nanogpt (compile, bf16 autocast, SDPA, fused AdamW)" | tee -a $O/train.txt
  timeout 120 python3 bench/bench_torch.py $args --steps $steps --warmup 5 --device cuda --nanogpt 2>&1 | grep "train:" | tee -a $O/train.txt
done
profile_bf16 $PROFILE
exit 0
