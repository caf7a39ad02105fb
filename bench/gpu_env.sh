# Sourced by bench/run_gpu*.sh on the device machine (`source "$(dirname "$0")/gpu_env.sh"`): installs the carried
# cp312 wheels (.whl/: pyopencl and what clgpt imports) into /tmp/site and points the OpenCL loader at NVIDIA's
# library through an ICD file of our own (the image registers none). Run from the repository root (carry .whl),
# or from a worktree under .wt/ (the wheels two folders up), or set WHL to the wheels' folder.
W=${WHL:-.whl}
[ -d "$W" ] || W=../../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
mkdir -p /tmp/icd && echo /usr/lib/libnvidia-opencl.so.1 >/tmp/icd/nvidia.icd && export OCL_ICD_VENDORS=/tmp/icd
[ -e /usr/lib/libnvidia-opencl.so.1 ] || echo /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1 >/tmp/icd/nvidia.icd

# profile_bf16 SHAPE...: per-kernel device times (CLGPT_BENCH_PROFILE) of `clgpt bench` in bf16 at each shape, its
# arguments in the caller's variable of that name, into $O/profile.txt (bench/run_gpu_flash.sh, run_gpu_operands.sh)
profile_bf16() {
  for shape in "$@"; do
    eval args=\$$shape
    echo "== $shape profile" | tee -a $O/profile.txt
    CLGPT_BENCH_PROFILE=1 timeout 90 python3 -m clgpt bench $args --steps 3 --gemm 0 --precision bf16 2>&1 \
      | grep -A60 "^profile" | tee -a $O/profile.txt
  done
}
