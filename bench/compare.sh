#!/usr/bin/env bash
# clgpt against its PyTorch peer on this machine, shapes S and M, in one go; prints a table of ratios.
#
#   bash bench/compare.sh                       # REPEATS=3 STEPS_S=30 STEPS_M=6 GEMM=1024 TORCH_THREADS="0 1"
#   REPEATS=5 STEPS_M=10 bash bench/compare.sh  # longer, steadier
#   SHAPES="S M L" DEVICE=cuda TORCH_THREADS=0 bash bench/compare.sh   # on a GPU machine (L is GPU only)
#
# Runs alternate (clgpt, torch, torch 1 thread, clgpt, ...) so that all see the same machine; each figure
# is the best of REPEATS runs (the one least disturbed by whatever else runs). The peer is PyTorch eager
# fp32 with its default intra-op threads (all cores) and, on the CPU, also with 1 thread: on a shared
# 2-core machine torch's 2-thread OpenMP loses much when another process takes a core, so the ratio is
# given against the faster of the two (the strongest peer) as well as against each.
# Needs torch (pip install torch==2.13.0; it is no dependency of clgpt). Raw logs go to $LOG_DIR.
# Env: PYTHON, REPEATS, STEPS_S, STEPS_M, STEPS_L, GEMM (0 = skip), SHAPES, DEVICE (torch: cpu|cuda),
#      TORCH_THREADS (torch --threads values, 0 = torch's default), CLGPT_DEVICE (clgpt --device), LOG_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
REPEATS=${REPEATS:-3}
STEPS_S=${STEPS_S:-30}
STEPS_M=${STEPS_M:-6}
STEPS_L=${STEPS_L:-10}
GEMM=${GEMM:-1024}
SHAPES=${SHAPES:-"S M"}
DEVICE=${DEVICE:-cpu}
if [ "$DEVICE" = cpu ]; then TORCH_THREADS=${TORCH_THREADS:-"0 1"}; else TORCH_THREADS=${TORCH_THREADS:-0}; fi
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/clgpt-compare.XXXXXX)}
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/*.log

shape_args() {
  case "$1" in
    S) echo "--vocab 512 --ctx 80 --embd 64 --ffn 128 --heads 2 --layers 1 --batch 8 --steps $STEPS_S" ;;
    M) echo "--vocab 4096 --ctx 256 --embd 256 --ffn 1024 --heads 4 --layers 4 --batch 8 --steps $STEPS_M" ;;
    L) echo "--vocab 8192 --ctx 512 --embd 768 --ffn 3072 --heads 12 --layers 12 --batch 16 --steps $STEPS_L" ;;
    *) echo "unknown shape $1" >&2; exit 2 ;;
  esac
}

dev_arg=()
if [ -n "${CLGPT_DEVICE:-}" ]; then dev_arg=(--device "$CLGPT_DEVICE"); fi
first_shape=${SHAPES%% *}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  "$PYTHON" -c 'import numpy, torch; print("numpy", numpy.__version__, "| torch", torch.__version__)'
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$LOG_DIR/header.txt"

for shape in $SHAPES; do
  args=$(shape_args "$shape")
  for r in $(seq 1 "$REPEATS"); do
    g=0
    if [ "$shape" = "$first_shape" ] && [ "$r" = 1 ]; then g=$GEMM; fi
    log="$LOG_DIR/clgpt_${shape}_$r.log"
    echo "[$shape $r/$REPEATS] $PYTHON -m clgpt bench $args --gemm $g ${dev_arg[*]:-}" >&2
    "$PYTHON" -m clgpt bench $args --gemm "$g" "${dev_arg[@]}" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
    for th in $TORCH_THREADS; do
      log="$LOG_DIR/torch${th}_${shape}_$r.log"
      tg=$g
      [ "$th" != "${TORCH_THREADS%% *}" ] && tg=0  # torch's GEMM once, with its default threads
      echo "[$shape $r/$REPEATS] $PYTHON bench/bench_torch.py $args --gemm $tg --device $DEVICE --threads $th" >&2
      "$PYTHON" bench/bench_torch.py $args --gemm "$tg" --device "$DEVICE" --threads "$th" >"$log" 2>&1 \
        || { cat "$log" >&2; exit 1; }
    done
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG_DIR/header.txt"

"$PYTHON" - "$LOG_DIR" "$SHAPES" "$TORCH_THREADS" "$GEMM" <<'EOF' | tee "$LOG_DIR/table.md"
import glob, re, sys
log_dir, shapes, threads, gemm = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])

def runs(prefix, shape):
    out = []
    for path in sorted(glob.glob(f"{log_dir}/{prefix}_{shape}_*.log")):
        text = open(path).read()
        last = text.strip().splitlines()[-1]
        m = re.fullmatch(r"tokens/s=([0-9.]+)", last)
        if not m:
            sys.exit(f"{path}: last line {last!r} is not tokens/s=<n>")
        ms = float(re.search(r", ([0-9.]+) ms/step", text).group(1))
        cpu = float(re.search(r", ([0-9.]+) ms CPU time/step", text).group(1))
        out.append(dict(tps=float(m.group(1)), ms=ms, cpu=cpu, text=text))
    return out

def name(th):
    return "torch" if th == "0" else f"torch {th}thr"

def first(pattern, text):
    m = re.search(pattern, text)
    return m.group(1) if m else "?"

dev = first(r"(?m)^device: (.*)$", open(glob.glob(f"{log_dir}/clgpt_*_1.log")[0]).read())
peer = first(r"(?m)^device: (.*)$", open(glob.glob(f"{log_dir}/torch*_1.log")[0]).read())
print(f"\nclgpt: {dev}\npeer:  {peer}\n")
cols = ["shape", "clgpt tok/s"] + [f"{name(t)} tok/s" for t in threads] + [f"clgpt/{name(t)}" for t in threads]
if len(threads) > 1:
    cols.append("clgpt/best torch")
cols += ["clgpt ms/step", "clgpt CPU ms/step"] + [f"{name(t)} CPU ms/step" for t in threads]
print("| " + " | ".join(cols) + " |")
print("|" + "|".join("---:" if i else "---" for i in range(len(cols))) + "|")
for shape in shapes:
    ours = runs("clgpt", shape)
    peers = [runs(f"torch{t}", shape) for t in threads]
    o = max(r["tps"] for r in ours)
    p = [max(r["tps"] for r in rs) for rs in peers]
    row = [shape, f"{o:,.0f}"] + [f"{x:,.0f}" for x in p] + [f"{o / x:.2f}" for x in p]
    if len(threads) > 1:
        row.append(f"**{o / max(p):.2f}**")
    row += [f"{min(r['ms'] for r in ours):.1f}", f"{min(r['cpu'] for r in ours):.1f}"]
    row += [f"{min(r['cpu'] for r in rs):.1f}" for rs in peers]
    print("| " + " | ".join(row) + " |")
print(f"\ntok/s: best of {len(ours)} runs each; clgpt/X > 1 means clgpt trains faster. CPU ms/step: process CPU time"
      " (all threads) per step, least of the runs.")
if gemm:
    o = open(glob.glob(f"{log_dir}/clgpt_{shapes[0]}_1.log")[0]).read()
    t = open(glob.glob(f"{log_dir}/torch{threads[0]}_{shapes[0]}_1.log")[0]).read()
    cl_gf = float(first(r"OpenCL ([0-9.]+) GFLOP/s", o))
    np_gf = float(first(r"numpy ([0-9.]+) GFLOP/s", o))
    t_gf = float(first(r"torch matmul \([^)]*\) ([0-9.]+) GFLOP/s", t))
    blas = first(r"numpy [0-9.]+ GFLOP/s \(([^)]*)\)", o)
    check = first(r"(gemm check: \w+ \(max rel err [0-9.e+-]+)", o)
    print(f"\nGEMM {gemm}^2 fp32, C = A @ B: clgpt OpenCL {cl_gf:.1f} GFLOP/s | numpy {np_gf:.1f} GFLOP/s ({blas}) | "
          f"torch {t_gf:.1f} GFLOP/s. OpenCL/numpy {cl_gf / np_gf:.2f}, OpenCL/torch {cl_gf / t_gf:.2f}; {check})")
EOF
echo "logs: $LOG_DIR"
