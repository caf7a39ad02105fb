#!/usr/bin/env bash
# clgpt against its PyTorch peer on this machine, shapes S and M, in one go.
#
#   bash bench/compare.sh                      # REPEATS=2 STEPS_S=30 STEPS_M=4 GEMM=1024
#   REPEATS=3 STEPS_M=6 bash bench/compare.sh  # longer
#   SHAPES="S M L" DEVICE=cuda bash bench/compare.sh   # L is for a GPU only
#
# The two run alternately (clgpt, torch, clgpt, torch, ...) so that both see the same machine; each
# figure is the best of REPEATS runs (the least disturbed by whatever else the machine runs). Needs torch
# installed (pip install torch==2.13.0; it is no dependency of clgpt). Raw logs go to $LOG_DIR.
# Env: PYTHON, REPEATS, STEPS_S, STEPS_M, STEPS_L, GEMM (0 = skip), SHAPES, DEVICE (torch: cpu|cuda),
#      CLGPT_DEVICE (clgpt --device), LOG_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
REPEATS=${REPEATS:-2}
STEPS_S=${STEPS_S:-30}
STEPS_M=${STEPS_M:-4}
STEPS_L=${STEPS_L:-10}
GEMM=${GEMM:-1024}
SHAPES=${SHAPES:-"S M"}
DEVICE=${DEVICE:-cpu}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/clgpt-compare.XXXXXX)}
mkdir -p "$LOG_DIR"

shape_args() {
  case "$1" in
    S) echo "--vocab 512 --ctx 80 --embd 64 --ffn 128 --heads 2 --layers 1 --batch 8 --steps $STEPS_S" ;;
    M) echo "--vocab 4096 --ctx 256 --embd 256 --ffn 1024 --heads 4 --layers 4 --batch 8 --steps $STEPS_M" ;;
    L) echo "--vocab 8192 --ctx 512 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 16 --steps $STEPS_L" ;;
    *) echo "unknown shape $1" >&2; exit 2 ;;
  esac
}

# the number after KEY= on the last line, or after "KEY" anywhere (first match)
last_tps() { tail -n 1 "$1" | sed -n 's/^tokens\/s=\([0-9.]*\)$/\1/p'; }
field() { sed -n "s#.*$2.*#\\1#p" "$1" | head -n 1; }
best() { printf '%s\n' "$@" | sort -g | tail -n 1; }
least() { printf '%s\n' "$@" | sort -g | head -n 1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "n/a" }'; }

dev_arg=()
[ -n "${CLGPT_DEVICE:-}" ] && dev_arg=(--device "$CLGPT_DEVICE")

echo "clgpt vs PyTorch, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $REPEATS runs each (best kept), logs in $LOG_DIR"
"$PYTHON" -c 'import torch; print("torch", torch.__version__)'
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

declare -A OURS_TPS TORCH_TPS OURS_MS TORCH_MS OURS_CPU TORCH_CPU
GEMM_CL=() GEMM_NP=() GEMM_TORCH=() GEMM_CHECK=""
for shape in $SHAPES; do
  args=$(shape_args "$shape")
  o_tps=() t_tps=() o_ms=() t_ms=() o_cpu=() t_cpu=()
  for r in $(seq 1 "$REPEATS"); do
    g=0
    if [ "$shape" = "$(echo $SHAPES | cut -d' ' -f1)" ] && [ "$r" = 1 ]; then g=$GEMM; fi
    lo="$LOG_DIR/clgpt_${shape}_$r.log" lt="$LOG_DIR/torch_${shape}_$r.log"
    echo "[$shape run $r] $PYTHON -m clgpt bench $args --gemm $g ${dev_arg[*]}" >&2
    "$PYTHON" -m clgpt bench $args --gemm "$g" "${dev_arg[@]}" >"$lo" 2>&1 || { cat "$lo" >&2; exit 1; }
    echo "[$shape run $r] $PYTHON bench/bench_torch.py $args --gemm $g --device $DEVICE" >&2
    "$PYTHON" bench/bench_torch.py $args --gemm "$g" --device "$DEVICE" >"$lt" 2>&1 || { cat "$lt" >&2; exit 1; }
    o_tps+=("$(last_tps "$lo")") t_tps+=("$(last_tps "$lt")")
    o_ms+=("$(field "$lo" ', \([0-9.]*\) ms/step')") t_ms+=("$(field "$lt" ', \([0-9.]*\) ms/step')")
    o_cpu+=("$(field "$lo" ', \([0-9.]*\) ms CPU time/step')") t_cpu+=("$(field "$lt" ', \([0-9.]*\) ms CPU time/step')")
    if [ "$g" != 0 ]; then
      GEMM_CL+=("$(field "$lo" 'OpenCL \([0-9.]*\) GFLOP/s')")
      GEMM_NP+=("$(field "$lo" 'numpy \([0-9.]*\) GFLOP/s')")
      GEMM_TORCH+=("$(field "$lt" 'torch matmul ([^)]*) \([0-9.]*\) GFLOP/s')")
      GEMM_CHECK=$(grep -o 'gemm check: [a-zA-Z]* (max rel err [^ ]*' "$lo" || true)
      GEMM_BLAS=$(field "$lo" 'numpy [0-9.]* GFLOP/s (\([^)]*\))')
    fi
  done
  OURS_TPS[$shape]=$(best "${o_tps[@]}") TORCH_TPS[$shape]=$(best "${t_tps[@]}")
  OURS_MS[$shape]=$(least "${o_ms[@]}") TORCH_MS[$shape]=$(least "${t_ms[@]}")
  OURS_CPU[$shape]=$(least "${o_cpu[@]}") TORCH_CPU[$shape]=$(least "${t_cpu[@]}")
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
head -n 1 "$LOG_DIR"/clgpt_*_1.log | grep '^device' | head -n 1 | sed 's/^/clgpt /'
grep -h '^device' "$LOG_DIR"/torch_*_1.log | head -n 1 | sed 's/^/peer  /'

echo
printf '| %-5s | %14s | %14s | %11s | %13s | %13s | %15s | %15s | %11s |\n' shape "clgpt tok/s" "torch tok/s" "clgpt/torch" "clgpt ms/step" "torch ms/step" "clgpt CPU ms/st" "torch CPU ms/st" "CPU ratio"
printf '| %-5s | %14s | %14s | %11s | %13s | %13s | %15s | %15s | %11s |\n' ----- -------------- -------------- ----------- ------------- ------------- --------------- --------------- -----------
for shape in $SHAPES; do
  printf '| %-5s | %14s | %14s | %11s | %13s | %13s | %15s | %15s | %11s |\n' "$shape" \
    "${OURS_TPS[$shape]}" "${TORCH_TPS[$shape]}" "$(ratio "${OURS_TPS[$shape]}" "${TORCH_TPS[$shape]}")" \
    "${OURS_MS[$shape]}" "${TORCH_MS[$shape]}" "${OURS_CPU[$shape]}" "${TORCH_CPU[$shape]}" \
    "$(ratio "${TORCH_CPU[$shape]}" "${OURS_CPU[$shape]}")"
done
echo "(clgpt/torch: tokens/s ratio, > 1 means clgpt is faster; CPU ratio: torch CPU time / clgpt CPU time per step)"
if [ "${#GEMM_CL[@]}" -gt 0 ]; then
  echo
  echo "GEMM ${GEMM}^2 fp32, C = A @ B: clgpt OpenCL ${GEMM_CL[0]} GFLOP/s, numpy ${GEMM_NP[0]} GFLOP/s ($GEMM_BLAS)," \
       "torch ${GEMM_TORCH[0]} GFLOP/s; OpenCL/numpy $(ratio "${GEMM_CL[0]}" "${GEMM_NP[0]}")," \
       "OpenCL/torch $(ratio "${GEMM_CL[0]}" "${GEMM_TORCH[0]}"); $GEMM_CHECK)"
fi
