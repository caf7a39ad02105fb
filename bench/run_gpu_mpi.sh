#!/bin/bash
# One device call on nvidia-h200-x2 (issue 16): 1 GPU vs 2 GPUs over MPI at S6 and L, the loss curve, the
# breakdown. From the repository root on the device machine: `bash bench/run_gpu_mpi.sh`
# (carry .whl). PYOPENCL_CTX stays unset so rank i takes the i-th GPU.
source "$(dirname "$0")/gpu_env.sh"  # wheels into /tmp/site, NVIDIA's OpenCL
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import mpi4py, mpi4py.MPI as M; print('mpi4py', mpi4py.__version__, M.Get_library_version().splitlines()[0])"
set -o pipefail
if [ "${1:-x2}" = one ]; then  # one GPU (when nvidia-h200-x2 is not lent): both ranks share it; the 1-rank timings,
  # the copies and the host-side sums are still what two GPUs would see, the 2-rank step times are not
  timeout 120 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape S6 --accum 4 --steps 3 --warmup 1 \
    --curve 40 --json $OUT/s6.json 2>&1 | grep -v Warn | tee $OUT/s6.txt
  timeout 120 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape L --accum 4 --steps 2 --warmup 1 \
    --json $OUT/l.json 2>&1 | grep -v Warn | tee $OUT/l.txt
  exit
fi
timeout 170 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape S6 --accum 1 --accum 4 --steps 5 \
  --warmup 2 --curve 40 --json $OUT/s6.json 2>&1 | grep -v Warn | tee $OUT/s6.txt
timeout 170 mpiexec --allow-run-as-root -n 2 python3 bench/bench_mpi.py --shape L --accum 4 --accum 8 --steps 4 \
  --warmup 1 --json $OUT/l.json 2>&1 | grep -v Warn | tee $OUT/l.txt
