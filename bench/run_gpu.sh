#!/bin/bash
# One device call: tests on NVIDIA OpenCL, GEMM sweep, training S/M/L vs PyTorch CUDA, profiles, pipeline.
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export PYOPENCL_CTX=0
MODE=${1:-full}   # full: everything; bench: no profiles; quick: no profiles, no GEMM sweep
nvidia-smi --query-gpu=name,driver_version --format=csv
S="--vocab 512 --ctx 80 --embd 64 --ffn 128 --heads 2 --layers 1 --batch 8"
timeout 170 python3 -m pytest tests/test_kernels.py tests/test_engine.py -q -x -p no:cacheprovider -W ignore 2>&1 | tail -15 | tee $OUT/tests.txt
[ $MODE != quick ] && timeout 60 python3 bench/gemm_sweep.py 4096 2>&1 | grep -v Warn | tee $OUT/gemm.txt
for shape in S M L; do
  eval args=\$$shape
  steps=30; [ $shape = L ] && steps=10
  echo "== $shape clgpt" | tee -a $OUT/train.txt
  timeout 100 python3 -m clgpt bench $args --steps $steps --gemm 0 2>&1 | grep -v "^  \|Warn" | tail -3 | tee -a $OUT/train.txt
  if [ $shape != L ]; then echo "== $shape clgpt CLGPT_PRESET=0" | tee -a $OUT/train.txt
  CLGPT_PRESET=0 timeout 100 python3 -m clgpt bench $args --steps $steps --gemm 0 2>&1 | grep -v "^  \|Warn" | tail -2 | tee -a $OUT/train.txt; fi
  echo "== $shape torch cuda" | tee -a $OUT/train.txt
  timeout 100 python3 bench/bench_torch.py $args --steps $steps --device cuda 2>&1 | tail -2 | tee -a $OUT/train.txt
done
if [ $MODE = full ]; then
echo "== M profile" | tee $OUT/profile.txt
CLGPT_BENCH_PROFILE=1 timeout 60 python3 -m clgpt bench $M --steps 2 --gemm 0 2>&1 | grep -v Warn | grep -v "^    0.0" | tail -36 | tee -a $OUT/profile.txt
echo "== L profile" | tee -a $OUT/profile.txt
CLGPT_BENCH_PROFILE=1 timeout 90 python3 -m clgpt bench $L --steps 2 --gemm 0 2>&1 | grep -v Warn | head -40 | tee -a $OUT/profile.txt
fi
# the default pipeline on this device
rm -rf results benchmarks logs model.gguf Modelfile .snakemake
( time timeout 240 python3 -m snakemake --cores 4 model.gguf ) > $OUT/pipeline_log.txt 2>&1; echo "snakemake rc=$?" | tee -a $OUT/pipeline_log.txt
tail -5 $OUT/pipeline_log.txt
mkdir -p $OUT/pipe
for f in benchmarks/*.tsv; do echo "== $f"; cat $f; done > $OUT/pipe/benchmarks.txt 2>&1
cp results/eval/report.md $OUT/pipe/report.md 2>/dev/null; true
cat $OUT/pipe/benchmarks.txt; grep -i -m5 "exact" results/eval/report.md
