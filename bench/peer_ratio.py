"""clgpt against the PyTorch peer as nanoGPT users run it, on a GPU: alternated pairs a shape, and the peer's check.

    python3 bench/peer_ratio.py --shape NAME STEPS "ARGS" [--shape ...] [--reps 2] [--check NAME ...]
                                [--jobs 3] [--budget 480] [--out DIR]

(`bash bench/gpu.sh peer` runs it with bench/gpu_env.sh's shapes.) ARGS are the `clgpt bench` and
bench/bench_torch.py arguments of a shape, STEPS its timed steps.

1. Each shape's peer (`bench/bench_torch.py ARGS --device cuda --nanogpt --serve`: torch.compile, bf16 autocast,
   SDPA, fused AdamW, batches resident on the device, or with --data host pinned and fetched ahead) starts and
   compiles, --jobs at a time, largest first; it then waits with its cached memory handed back. While they
   compile, `clgpt bench` runs each shape once, untimed, so that its kernel builds are in the driver's cache and
   the GPU's clocks are up. No timed run shares the machine with a compile: a peer not ready --compile-limit
   seconds after the start is killed, and clgpt runs alone at its shape.
2. Per shape, --reps times: one `clgpt bench` process (--precision, bf16), then one burst of that shape's waiting peer
   (`train STEPS` after 3 untimed steps). Each pair gives clgpt / PyTorch speed = peer ms / clgpt ms.
3. At each --check shape, the peer's `check R STEPS` (R = --check-rounds): its loop against a minimal
   nanoGPT-style loop on the same model, alternated in the same process (bench/bench_torch.py --check-minimal).
4. CHAR_MOE's clgpt step over CHAR_L's (the medians), where both ran.

The table (markdown) goes to stdout and to DIR/peer_table.md after each shape, so a run cut short keeps what
it measured; each peer's own output goes to DIR/torch_NAME.log. A shape not reached within --budget seconds of
the start is listed as not run.
"""

from __future__ import annotations

import argparse
import atexit
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = re.compile(r"train:.*?, ([0-9.]+) ms/step,.*?([0-9.]+) ms CPU time/step")
HOST = re.compile(r"host: ([0-9.]+) ms to issue a step")
# a peer whose host takes this share of its step to issue it runs at its host's pace, not the GPU's: its pairs are
# marked (h) in the table, since they measure the machine's CPU as much as the kernels
HOST_BOUND = 0.9


class PeerProcess:
    """One shape's bench/bench_torch.py --serve, its stdout read line by line on a thread."""

    def __init__(self, name: str, args: str, warmup: int, log: Path, device: str, data: str):
        self.name, self.lines, self.log = name, queue.Queue(), open(log, "w")
        where = ["--device", "cuda"] if device == "cuda" else ["--device", "cpu", "--no-compile", "--threads", "1"]
        cmd = [sys.executable, str(HERE / "bench_torch.py"), *shlex.split(args), *where, "--nanogpt", "--serve",
               "--warmup", str(warmup), "--data", data]
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1)
        self.log.write(f"pid {self.proc.pid}\n")
        self.log.flush()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # the process ended

    def wait_for(self, word: str, timeout: float) -> list[str]:
        """The lines up to and including one equal to `word`; raises if the process ends or time runs out first."""
        out, end = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: no '{word}' from the peer within {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"{self.name}: the peer ended (exit {self.proc.wait()}); see {self.log.name}")
            out.append(line)
            if line.strip() == word:
                return out

    def ask(self, command: str, timeout: float) -> list[str]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.wait_for("done", timeout)

    def close(self, kill: bool = False):
        """End it: at the end of its input, or killed (one still compiling must not run beside a timed run)."""
        if kill and self.proc.poll() is None:
            self.proc.kill()
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def clgpt_bench(args: str, steps: int, timeout: float, precision: str) -> tuple[float, float, str]:
    """-> (ms/step, CPU ms/step, the train: line) of `python3 -m clgpt bench ARGS` at `precision`."""
    cmd = [sys.executable, "-m", "clgpt", "bench", *shlex.split(args), "--steps", str(steps), "--gemm", "0",
           "--precision", precision]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    line = next((x for x in run.stdout.splitlines() if x.startswith("train:")), "")
    m = TRAIN.search(line)
    if run.returncode or not m:
        raise RuntimeError(f"clgpt bench {args}: exit {run.returncode}, no train: line\n"
                           f"{(run.stdout + run.stderr)[-1500:]}")
    return float(m.group(1)), float(m.group(2)), line


def peer_burst(peer: PeerProcess, steps: int, timeout: float) -> tuple[float, float, float]:
    """-> (ms/step, CPU ms/step, host ms to issue a step) of one timed burst of the waiting peer."""
    lines = peer.ask(f"train {steps}", timeout)
    text = "\n".join(lines)
    m, h = TRAIN.search(text), HOST.search(text)
    if not m or not h:
        raise RuntimeError(f"{peer.name}: no train:/host: line from the peer:\n{text[-1500:]}")
    return float(m.group(1)), float(m.group(2)), float(h.group(1))


def size_key(args: str) -> float:
    """A rough size of a shape's training work (layers x channels^2 x tokens): the peers compile largest first."""
    a = dict(re.findall(r"--([\w-]+) (\S+)", args))
    return int(a.get("layers", 1)) * int(a.get("embd", 64)) ** 2 * int(a.get("ctx", 80)) * int(a.get("batch", 8))


def table(rows: dict, checks: dict, moe: str, not_run: list[str], errors: dict) -> str:
    out = ["| shape | clgpt ms/step | PyTorch ms/step (CPU ms, host issue ms) | clgpt / PyTorch speed, per pair "
           "| median |",
           "| --- | --- | --- | --- | ---: |"]
    host_bound = False
    for name, pairs in rows.items():
        cl = ", ".join(f"{p['clgpt'][0]:.2f}" for p in pairs)
        if any(p["torch"] is None for p in pairs):  # its peer failed: clgpt alone (for the MoE ratio)
            out.append(f"| {name} | {cl} | (no peer) | | |")
            continue
        pt = ", ".join(f"{p['torch'][0]:.2f} ({p['torch'][1]:.2f}, {p['torch'][2]:.2f})" for p in pairs)
        ratios = [p["torch"][0] / p["clgpt"][0] for p in pairs]
        marks = [" (h)" if p["torch"][2] >= HOST_BOUND * p["torch"][0] else "" for p in pairs]
        host_bound = host_bound or any(marks)
        out.append(f"| {name} | {cl} | {pt} | {', '.join(f'{r:.3f}{m}' for r, m in zip(ratios, marks))} | "
                   f"**{statistics.median(ratios):.3f}x** |")
    out += [""] + [f"- {name}: {line}" for name, line in checks.items()]
    if host_bound:
        out.append(f"- (h): the peer's host took at least {HOST_BOUND:.0%} of its step to issue it (host issue ms "
                   "against ms/step): the host set its pace, so that ratio moves with the machine's CPU")
    if moe:
        out.append(f"- {moe}")
    if not_run:
        out.append(f"- not run (time budget): {', '.join(not_run)}")
    out += [f"- {name} failed: {why.splitlines()[0] if why else '?'}" for name, why in errors.items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=3, action="append", required=True, metavar=("NAME", "STEPS", "ARGS"))
    ap.add_argument("--reps", type=int, default=2, help="pairs a shape")
    ap.add_argument("--check", action="append", default=[], metavar="NAME",
                    help="shapes where the peer is checked against the minimal loop")
    ap.add_argument("--check-rounds", type=int, default=5, help="alternated rounds of the peer's check")
    ap.add_argument("--data", default="device", choices=["device", "host"],
                    help="the peer's batches (bench/bench_torch.py --data): device, resident there, so that a "
                         "host-bound peer spends no host time on them; host, nanoGPT's pinned copies")
    ap.add_argument("--warmup", type=int, default=5, help="the peers' untimed first steps (torch.compile runs in them)")
    ap.add_argument("--jobs", type=int, default=3, help="peers compiling at once (each holds GPU memory)")
    ap.add_argument("--compile-limit", type=float, default=300,
                    help="seconds after the start by which every peer must be compiled; a later one is dropped")
    ap.add_argument("--budget", type=float, default=480, help="seconds after which no further shape starts")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/out")
    ap.add_argument("--precision", default="bf16", help="clgpt's (`clgpt bench --precision`)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the peers on the CPU without torch.compile, to check this script off the GPU "
                         "(tests/test_bench_scripts.py); its figures mean nothing")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {name: (int(steps), a) for name, steps, a in args.shape}
    unknown = [c for c in args.check if c not in shapes]
    if unknown:
        ap.error(f"--check {' '.join(unknown)}: not among the --shape names ({' '.join(shapes)})")

    # 1. the peers compile, --jobs at a time, largest first; clgpt's untimed first runs go alongside
    peers: dict[str, PeerProcess] = {}
    # a timeout's TERM ends this script through SystemExit, and the peers it started end with it: left running, they
    # would share the GPU with whatever the device call runs next
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    atexit.register(lambda: [p.close(kill=True) for p in list(peers.values())])
    errors: dict[str, str] = {}  # shape: why it has no figures
    pending = sorted(shapes, key=lambda n: -size_key(shapes[n][1]))
    compiling: list[str] = []
    warm = list(shapes)
    warm_thread = None

    def warm_clgpt():
        while warm and (pending or compiling):
            name = warm.pop(0)
            try:
                clgpt_bench(shapes[name][1], 2, 240, args.precision)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"warm-up of clgpt at {name} failed: {str(e)[:300]}", flush=True)

    while pending or compiling:
        while pending and len(compiling) < args.jobs:
            name = pending.pop(0)
            peers[name] = PeerProcess(name, shapes[name][1], args.warmup, out / f"torch_{name}.log", args.device,
                                      args.data)
            compiling.append(name)
        if warm_thread is None:
            warm_thread = threading.Thread(target=warm_clgpt, daemon=True)
            warm_thread.start()
        name = compiling.pop(0)
        try:
            peers[name].wait_for("ready", max(5.0, args.compile_limit - (time.monotonic() - t_start)))
            print(f"peer {name} compiled and warm ({time.monotonic() - t_start:.0f} s)", flush=True)
        except RuntimeError as e:
            errors[name] = str(e)
            peers.pop(name).close(kill=True)
            print(f"peer {name}: {e}", flush=True)
    warm_thread.join()
    print(f"all peers ready after {time.monotonic() - t_start:.0f} s", flush=True)

    # 2.-4. alternated pairs, checks, the MoE ratio; the table after each shape
    rows, checks, not_run, moe = {}, {}, [], ""
    for name, (steps, a) in shapes.items():
        peer = peers.get(name)  # None where it failed to compile: clgpt still runs (CHAR_MOE's ratio needs it)
        if time.monotonic() - t_start > args.budget:
            not_run.append(name)
            if peer:
                peer.close()
            continue
        rows[name] = []
        try:
            for rep in range(args.reps):
                cl = clgpt_bench(a, steps, 180, args.precision)
                pt = peer_burst(peer, steps, 180) if peer else None
                rows[name].append({"clgpt": cl, "torch": pt})
                vs = (f"PyTorch {pt[0]:.2f} ms/step (CPU {pt[1]:.2f}, issue {pt[2]:.2f}): {pt[0] / cl[0]:.3f}x"
                      if pt else "no peer")
                print(f"{name} pair {rep + 1}: clgpt {cl[0]:.2f} ms/step, {vs}", flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            errors[name] = str(e)[:600]
            print(f"{name}: {errors[name]}", flush=True)
            if not rows[name]:
                del rows[name]
        if peer and name in args.check and name not in errors:
            try:
                text = "\n".join(peer.ask(f"check {args.check_rounds} {steps}", 300))
            except RuntimeError as e:
                text = str(e)
            m = re.search(r"^minimal check: .*$", text, re.M)
            checks[name] = m.group(0) if m else f"no check line: {text[-300:]}"
            print(f"{name} {checks[name]}", flush=True)
        if peer:
            peer.close()
        if "CHAR_MOE" in rows and "CHAR_L" in rows:
            med = {n: statistics.median(p["clgpt"][0] for p in rows[n]) for n in ("CHAR_MOE", "CHAR_L")}
            moe = (f"CHAR_MOE step / CHAR_L step (clgpt, medians): {med['CHAR_MOE']:.2f} / {med['CHAR_L']:.2f} = "
                   f"**{med['CHAR_MOE'] / med['CHAR_L']:.2f}x**")
        (out / "peer_table.md").write_text(table(rows, checks, moe, not_run, errors))
    text = table(rows, checks, moe, not_run, errors)
    (out / "peer_table.md").write_text(text)
    print(f"\n{text}total {time.monotonic() - t_start:.0f} s")
    failed = [n for n, line in checks.items() if "passed" not in line]
    return 1 if failed or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
