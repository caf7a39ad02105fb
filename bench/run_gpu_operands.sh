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
VARIANTS=("CLGPT_WGMMA_MN=0 CLGPT_WGMMA_EPI2=mma CLGPT_WGMMA_MIN_MNK=4294967296" "CLGPT_WGMMA_EPI2=mma" "" "CLGPT_WGMMA_EPI2=wgmma")
for shape in ${SHAPES:-M6 L}; do
  eval args=\$$shape; steps=30; [ $shape = L ] && steps=10
  for v in "${VARIANTS[@]}"; do (for a in $v; do export "$a"; done; clgpt_bf16 "$shape ${v:-default}" "$args" $steps); done
  torch_peer $shape "$args" $steps
done
profile_bf16 $PROFILE
exit 0
