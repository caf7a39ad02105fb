#!/bin/bash
# One device call for issue 15's training ratios: clgpt bf16 (defaults) and PyTorch torch.compile + bf16 autocast
# + SDPA + fused AdamW, alternated REPS times per shape (PyTorch's own step time moved by up to 1.8x between
# calls, so each ratio pairs runs of the same call; report the medians). From the repository root (carry .whl).
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
M="--vocab 4096 --ctx 256 --embd 256 --ffn 1024 --heads 4 --layers 4 --batch 8"
M6="--vocab 4096 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64"
L="--vocab 8192 --ctx 512 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 16"
for rep in $(seq ${REPS:-3}); do
  for shape in ${SHAPES:-M6 L M}; do
    eval args=\$$shape; steps=50; [ $shape = L ] && steps=20
    echo "== rep $rep $shape clgpt bf16" | tee -a $O/train.txt
    timeout 60 python3 -m clgpt bench $args --steps $steps --gemm 0 --precision bf16 2>&1 | grep "train:" | tee -a $O/train.txt
    echo "== rep $rep $shape torch nanogpt (compile, bf16 autocast, SDPA, fused AdamW)" | tee -a $O/train.txt
    timeout 120 python3 bench/bench_torch.py $args --steps $steps --warmup 5 --device cuda --nanogpt 2>&1 | grep "train:" | tee -a $O/train.txt
  done
done
exit 0
