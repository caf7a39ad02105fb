"""Runs a stage's MPI launch line and, when it fails, names the rank that failed.

    python -m clgpt.training.launch --stage pretrain --partial results/pretrain/model.ckpt.partial [--log LOG] \\
        -- mpiexec -n 2 python scripts/pretrain.py ARGS LOG

Each rank records itself (rank, pid, host, device; and its error, if it raised one) in a status folder
named by CLGPT_RANK_DIR (clgpt.training.dist). A rank killed outright (SIGKILL, out of memory, a lost node) cannot
say so itself. When every rank runs on this host, the wrapper watches their pids and names the first to end:
the launcher then kills the others, and its own report may name one of those. Otherwise the launcher's output
names the rank by its pid (MPICH) or its number (Open MPI, srun), and this wrapper maps that back to the rank.
It passes the launcher's output through, adds one `error:` line, and exits with the launcher's code. The
stage's outputs are written by rank 0 at the very end (temp + rename), so a failed launch leaves none; the last
`.partial` checkpoint stays for a resume.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import select
import socket
import subprocess
import sys
import tempfile
import threading

from clgpt import signals
from clgpt.training.dist import RANK_DIR_ENV

_TAIL = 20000  # characters of the launcher's output kept for the post-mortem
STOPPED = {signals.exit_code(s) for s in signals.STOP_SIGNALS}  # what the ranks exit with after a stop signal


def _ranks(folder: str) -> dict[int, dict]:
    out = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    rec = json.load(f)
                out[int(rec["rank"])] = rec
            except (OSError, ValueError, KeyError):
                pass
    return out


class FirstToEnd:
    """Watches the ranks' pids (from their status records) and keeps the rank whose process ended first.

    Only for ranks on this host, through Linux pidfds; `rank` stays None when a rank runs elsewhere, when two
    ends arrive in one wake-up, or where pidfds are missing."""

    def __init__(self, folder: str):
        self.folder, self.rank, self._fds, self._done = folder, None, {}, []
        self._ambiguous = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if hasattr(os, "pidfd_open") else None
        if self._thread:
            self._thread.start()

    def _open_new(self) -> None:
        for r, rec in _ranks(self.folder).items():
            if r in self._fds.values() or r in self._done or rec.get("host") != socket.gethostname():
                continue
            try:
                self._fds[os.pidfd_open(int(rec["pid"]))] = r
            except (OSError, ValueError, KeyError):
                pass  # already gone before it was seen: leave the naming to the launcher's output

    def _run(self) -> None:
        while not self._stop.is_set() and self.rank is None and not self._ambiguous:
            self._open_new()
            ended = select.select(list(self._fds), [], [], 0.05)[0] if self._fds else []
            if not ended and not self._fds:
                self._stop.wait(0.05)
            records = _ranks(self.folder) if ended else {}
            failed = [fd for fd in ended if not records.get(self._fds[fd], {}).get("finished")]
            for fd in set(ended) - set(failed):  # ended after its work was done: keep watching the others
                self._done.append(self._fds.pop(fd))
                os.close(fd)
            if len(failed) == 1:
                self.rank = self._fds[failed[0]]
            elif len(failed) > 1:
                self._ambiguous = True

    def stop(self, world: int) -> int | None:
        """The first rank to end with its work undone, if every one of `world` ranks was watched on this host."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        watched = len(self._fds) + len(self._done)
        for fd in self._fds:
            os.close(fd)
        self._fds = {}
        return self.rank if watched == world and not self._ambiguous else None


def culprit(output: str, ranks: dict[int, dict], first: int | None = None) -> tuple[int | None, str]:
    """(rank, why) of the failed rank, from the ranks' own records, the rank seen to end `first`, and the MPI
    launcher's output."""
    for r in sorted(ranks):
        if ranks[r].get("error"):
            return r, ranks[r]["error"]
    signal = re.search(r"(Killed \(signal \d+\)|signal \d+[^\n]*|EXIT CODE: \d+)", output)
    why = signal.group(1).strip() if signal else "exited"
    if first is not None:
        return first, why
    m = re.search(r"process rank (\d+)", output) or re.search(r"rank (\d+) .*?(?:exited|killed|terminated)", output, re.I)
    if m:  # Open MPI ("mpiexec noticed that process rank 1 with PID ..."), srun ("task 1")
        return int(m.group(1)), why
    m = re.search(r"task (\d+)[^\n]*(?:exited|killed|terminated)", output, re.I)
    if m:
        return int(m.group(1)), why
    for pid in re.findall(r"PID (\d+)", output):  # MPICH hydra names the pid only
        for r, rec in ranks.items():
            if str(rec.get("pid")) == pid:
                return r, why
    return None, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clgpt.training.launch", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True)
    ap.add_argument("--partial", default="", help="the stage's resumable checkpoint, named in the message")
    ap.add_argument("--log", default="", help="append the error line here too (the rule's log)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("give the launch command after --")
    parent = os.path.dirname(os.path.abspath(a.partial)) if a.partial else None
    if parent:
        os.makedirs(parent, exist_ok=True)  # shared between hosts on a cluster, like the outputs
    folder = tempfile.mkdtemp(prefix=f".{a.stage}-ranks-", dir=parent)
    tail = ""
    watch = None
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, RANK_DIR_ENV: folder})
        watch = FirstToEnd(folder)
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(65536)
            if not chunk:
                break
            text = chunk.decode("utf-8", "replace")
            sys.stderr.write(text)
            sys.stderr.flush()
            tail = (tail + text)[-_TAIL:]
        rc = proc.wait()
        ranks = _ranks(folder)
        world = max((int(rec.get("size", 0)) for rec in ranks.values()), default=0) or len(ranks)
        first = watch.stop(world)
        if rc == 0:
            return 0
        if rc in STOPPED:  # the ranks stopped on a signal and saved; rank 0 said so in its one line
            return rc
        rank, why = culprit(tail, ranks, first)
        if rank is None:
            who = "an MPI rank"
        else:
            rec = ranks.get(rank, {})
            where = f" (pid {rec['pid']} on {rec['host']}{', ' + rec['device'] if rec.get('device') else ''})" if rec else ""
            who = f"MPI rank {rank} of {world or '?'}{where}"
        kept = (f"the last checkpoint is kept at {a.partial}; run again to resume" if a.partial and os.path.exists(a.partial)
                else "no checkpoint was written yet")
        msg = f"error: {a.stage}: {who} failed: {why}; the stage's outputs were not written; {kept}"
        if tail and not tail.endswith("\n"):  # a rank's line cut short by MPI_Abort: ours starts a line of its own
            sys.stderr.write("\n")
        print(msg, file=sys.stderr, flush=True)
        if a.log:
            with open(a.log, "a", encoding="utf-8") as f:
                f.write(msg + "\n")
        return rc
    finally:
        if watch is not None:
            watch.stop(0)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
