#!/usr/bin/env bash
# clgpt against its PyTorch peer on this machine, shapes S and M, in one go; prints a table of ratios.
#
#   bash bench/compare.sh                       # REPEATS=3 STEPS_S=30 STEPS_M=6 GEMM=1024 THREADS="0 1"
#   REPEATS=5 STEPS_M=10 bash bench/compare.sh  # longer, steadier
#   SHAPES="S M L" DEVICE=cuda bash bench/compare.sh   # on a GPU machine (L is GPU only)
#   ARCH_ARGS="--arch llama" bash bench/compare.sh      # llama against the PyTorch llama peer
#   ARCH_ARGS="--arch llama --experts 4 --experts-used 2" bash bench/compare.sh
#
# Runs alternate (clgpt, torch, clgpt 1 thread, torch 1 thread, clgpt, ...) so that all see the same
# machine; each figure is the best of REPEATS runs (the one least disturbed by whatever else runs). The peer
# is PyTorch eager fp32. On the CPU both run twice: with their default threads (all cores: PoCL's pthread
# device, torch's OpenMP) and with 1 thread each (POCL_CPU_MAX_CU_COUNT=1 / torch.set_num_threads(1)). On a
# shared 2-core machine the 1-thread pair is the steadier comparison: torch's 2-thread OpenMP loses much
# (up to 10x per step, seen here) whenever another process takes a core.
# Needs torch (pip install torch==2.13.0; it is no dependency of clgpt). Raw logs go to $LOG_DIR.
# Env: PYTHON, REPEATS, STEPS_S, STEPS_M, STEPS_L, GEMM (0 = skip), SHAPES, DEVICE (torch: cpu|cuda),
#      THREADS (thread counts to run, 0 = each one's default; on cuda only 0), CLGPT_DEVICE (clgpt --device),
#      ARCH_ARGS (--arch gpt2|llama [--kv-heads N] [--experts E --experts-used K], given to both), LOG_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
REPEATS=${REPEATS:-3}
STEPS_S=${STEPS_S:-30}
STEPS_M=${STEPS_M:-6}
STEPS_L=${STEPS_L:-10}
GEMM=${GEMM:-1024}
SHAPES=${SHAPES:-"S M"}
ARCH_ARGS=${ARCH_ARGS:-}
DEVICE=${DEVICE:-cpu}
if [ "$DEVICE" = cpu ]; then THREADS=${THREADS:-"0 1"}; else THREADS=${THREADS:-0}; fi
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
  args="$(shape_args "$shape") $ARCH_ARGS"
  for r in $(seq 1 "$REPEATS"); do
    g=0
    if [ "$shape" = "$first_shape" ] && [ "$r" = 1 ]; then g=$GEMM; fi
    for th in $THREADS; do
      [ "$th" != "${THREADS%% *}" ] && g=0  # the GEMM figures once, with the first thread setting
      penv=()
      if [ "$th" != 0 ]; then penv=(env "POCL_CPU_MAX_CU_COUNT=$th" "POCL_MAX_PTHREAD_COUNT=$th"); fi
      log="$LOG_DIR/clgpt${th}_${shape}_$r.log"
      echo "[$shape $r/$REPEATS] ${penv[*]:-} $PYTHON -m clgpt bench $args --gemm $g ${dev_arg[*]:-}" >&2
      "${penv[@]}" "$PYTHON" -m clgpt bench $args --gemm "$g" "${dev_arg[@]}" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
      log="$LOG_DIR/torch${th}_${shape}_$r.log"
      echo "[$shape $r/$REPEATS] $PYTHON bench/bench_torch.py $args --gemm $g --device $DEVICE --threads $th" >&2
      "$PYTHON" bench/bench_torch.py $args --gemm "$g" --device "$DEVICE" --threads "$th" >"$log" 2>&1 \
        || { cat "$log" >&2; exit 1; }
    done
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG_DIR/header.txt"

"$PYTHON" - "$LOG_DIR" "$SHAPES" "$THREADS" "$GEMM" <<'EOF' | tee "$LOG_DIR/table.md"
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

def first(pattern, text):
    m = re.search(pattern, text)
    return m.group(1) if m else "?"

t0 = threads[0]
dev = first(r"(?m)^device: (.*)$", open(glob.glob(f"{log_dir}/clgpt{t0}_*_1.log")[0]).read())
peer = first(r"(?m)^device: (.*)$", open(glob.glob(f"{log_dir}/torch{t0}_*_1.log")[0]).read())
print(f"\nclgpt: {dev}\npeer:  {peer}\n")
cols = ["shape", "threads", "clgpt tok/s", "torch tok/s", "clgpt/torch", "clgpt ms/step", "torch ms/step",
        "clgpt CPU ms/step", "torch CPU ms/step", "CPU torch/clgpt"]
print("| " + " | ".join(cols) + " |")
print("|" + "|".join("---:" if i > 1 else "---" for i in range(len(cols))) + "|")
for shape in shapes:
    for th in threads:
        ours, peers = runs(f"clgpt{th}", shape), runs(f"torch{th}", shape)
        o, p = max(r["tps"] for r in ours), max(r["tps"] for r in peers)
        oc, pc = min(r["cpu"] for r in ours), min(r["cpu"] for r in peers)
        row = [shape, "default" if th == "0" else th, f"{o:,.0f}", f"{p:,.0f}", f"**{o / p:.2f}**",
               f"{min(r['ms'] for r in ours):.1f}", f"{min(r['ms'] for r in peers):.1f}", f"{oc:.1f}", f"{pc:.1f}",
               f"{pc / oc:.2f}"]
        print("| " + " | ".join(row) + " |")
print(f"\ntok/s: best of {len(ours)} runs each; clgpt/torch > 1 means clgpt trains faster. CPU ms/step: process"
      " CPU time (all threads) per step, least of the runs; CPU torch/clgpt > 1 means clgpt spends less CPU.")
if gemm:
    o = open(glob.glob(f"{log_dir}/clgpt{t0}_{shapes[0]}_1.log")[0]).read()
    t = open(glob.glob(f"{log_dir}/torch{t0}_{shapes[0]}_1.log")[0]).read()
    cl_gf = float(first(r"OpenCL ([0-9.]+) GFLOP/s", o))
    np_gf = float(first(r"numpy ([0-9.]+) GFLOP/s", o))
    t_gf = float(first(r"torch matmul \([^)]*\) ([0-9.]+) GFLOP/s", t))
    blas = first(r"numpy [0-9.]+ GFLOP/s \(([^)]*)\)", o)
    check = first(r"(gemm check: \w+ \(max rel err [0-9.e+-]+)", o)
    print(f"\nGEMM {gemm}^2 fp32, C = A @ B: clgpt OpenCL {cl_gf:.1f} GFLOP/s | numpy {np_gf:.1f} GFLOP/s ({blas}) | "
          f"torch {t_gf:.1f} GFLOP/s. OpenCL/numpy {cl_gf / np_gf:.2f}, OpenCL/torch {cl_gf / t_gf:.2f}; {check})")
EOF
echo "logs: $LOG_DIR"
