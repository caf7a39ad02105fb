#!/bin/bash
# One device call (issue 15): the character recipe's training step (6 layers, 384 channels, 6 heads, context 256,
# batch 64, vocabulary 65) in `clgpt bench`, bf16, with and without the recipe's dropout 0.2: the engine's own
# step time, to set beside the pretrain stage's (bench/run_gpu_char_speed.sh's log). From the repository root
# (carry .whl).
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
CHAR="--vocab 65 --ctx 256 --embd 384 --ffn 1536 --heads 6 --layers 6 --batch 64 --steps 50 --gemm 0 --precision bf16"
for d in 0 0.2; do
  echo "== char recipe step, dropout $d"
  timeout 60 python3 -m clgpt bench $CHAR --dropout $d 2>&1 | grep "train:\|memory:"
done
