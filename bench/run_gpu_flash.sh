#!/bin/bash
# One device call for flash attention (issue 15): bench/flash_check.py (the kernels on the tensor cores against
# float64, and attention forward + backward against the batched form and PyTorch's SDPA), then training at M, M6
# and L in bf16 with flash attention and without (CLGPT_FLASH=off) beside PyTorch torch.compile + bf16 autocast +
# SDPA + fused AdamW; PROFILE="M6 L": then per-kernel device times of those shapes. From the repository root
# (carry .whl).
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 90 python3 bench/gpu_tc.py check 2>&1 | grep -v Warn | tail -3 | tee $O/check.txt
CLGPT_NV_VERBOSE=1 PYOPENCL_COMPILER_OUTPUT=1 timeout 150 python3 bench/flash_check.py 2>&1 \
  | grep -v "Warn\|lambda\|^$" | grep -i "flash\|check\|ms\|registers\|spill\|error" | tee $O/flash.txt
grep -q "flash check: passed" $O/flash.txt || { echo "flash check failed: stopping"; exit 1; }
for shape in ${SHAPES:-M6 L M}; do
  eval args=\$$shape; steps=30; [ $shape = L ] && steps=10
  for f in on off; do CLGPT_FLASH=$f clgpt_bf16 "$shape flash $f" "$args" $steps; done
  torch_peer $shape "$args" $steps
done
profile_bf16 $PROFILE
exit 0
