#!/bin/bash
# One device call for training ratios: clgpt bf16 (defaults) and PyTorch torch.compile + bf16 autocast + SDPA +
# fused AdamW, alternated REPS times per shape (PyTorch's own step time moved by up to 1.8x between calls, so each
# ratio pairs runs of the same call; report the medians). SHAPES names gpu_env.sh's variables (default M6 L M);
# BASE, a worktree of an earlier commit under .wt/ (carried), adds its clgpt to each pair, to measure a change.
# From the repository root (carry .whl).
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
# the first process of a call ran 10-15% slower (round 10: M6 10.0-10.3 ms against 8.85 later in the same call):
# one untimed run of each side first
[ -n "${NOWARM:-}" ] || (O=/tmp; clgpt_bf16 warm-up "$M6" 20 >/dev/null; torch_peer warm-up "$M6" 20 >/dev/null)
for rep in $(seq ${REPS:-3}); do
  for shape in ${SHAPES:-M6 L M}; do
    eval args=\$$shape; steps=50; case $shape in L|GPT2*) steps=20;; esac
    if [ -n "${BASE:-}" ]; then
      (cd "$BASE" && PYTHONPATH=/tmp/site:$PWD CLGPT_SIDE=base clgpt_bf16 "rep $rep $shape" "$args" $steps)
    fi
    clgpt_bf16 "rep $rep $shape" "$args" $steps
    torch_peer "rep $rep $shape" "$args" $steps
  done
done
exit 0
