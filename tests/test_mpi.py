"""Data parallelism over MPI (clgpt.training.dist) on a tiny model, ranks sharing the CPU's OpenCL device:
gradients of two ranks against one, bit-identical runs, resume, a killed rank named by the launcher."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clgpt.errors import ClgptError
from clgpt.io.checkpoint import load_checkpoint
from clgpt.training.launch import FirstToEnd, culprit
from clgpt.training.train import run_stage
from test_pipeline import assert_one_line, default_signals
from test_train import TINY, dialog_docs, settings, text_docs, write_encoded

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "mpi_worker.py")
_BESIDE = Path(sys.executable).with_name("mpiexec")
MPIEXEC = str(_BESIDE) if _BESIDE.exists() else shutil.which("mpiexec")


def mpirun(n: int, spec: dict, launch: str | None = None, partial: str = "") -> subprocess.CompletedProcess:
    """`mpiexec -n n python tests/mpi_worker.py SPEC`, through clgpt.training.launch when `launch` names the stage."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, WORKER, json.dumps(spec)]
    if launch:
        cmd = [sys.executable, "-m", "clgpt.training.launch", "--stage", launch, "--partial", partial, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, preexec_fn=default_signals)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("encoded")
    docs, pos = dialog_docs()
    out = {"text": write_encoded(d / "pretrain.bin", text_docs()),
           "dialog": write_encoded(d / "tune.bin", docs, "dialog", pos)}
    pre = d / "pre"
    pre.mkdir()
    run_stage("pretrain", out["text"], settings(steps=4), str(pre / "model.ckpt"), str(pre / "log.csv"), model=TINY)
    out["pretrained"] = str(pre / "model.ckpt")
    return out


def stage_args(data, out: Path, **kw) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    return {"stage": "pretrain", "encoded": data["text"], "settings": settings(**kw),
            "ckpt_out": str(out / "model.ckpt"), "log_csv": str(out / "log.csv"), "model": TINY}


@pytest.mark.parametrize("stage,kw,arch", [
    ("pretrain", dict(batch_size=4), "gpt2"),
    ("pretrain", dict(batch_size=5, accum_steps=2), "gpt2"),  # uneven rows (2 + 3), one reduce for both micro-batches
    ("tune", dict(batch_size=5, mix_pretrain=0.4), "gpt2"),  # dialog rows on one rank, mixed-in text on the other
    ("pretrain", dict(batch_size=4), "llama"),
])
def test_two_ranks_give_the_one_rank_gradients(data, tmp_path, stage, kw, arch):
    spec = {"mode": "grads", "stage": stage, "settings": settings(ranks=2, **kw), "out": str(tmp_path / "g.npz"),
            "model": {**TINY, "arch": arch}, "encoded": data["text"] if stage == "pretrain" else data["dialog"],
            "init_ckpt": data["pretrained"], "mix_encoded": data["text"]}
    r = mpirun(2, spec)
    assert r.returncode == 0, r.stderr
    g = np.load(tmp_path / "g.npz")
    assert bool(g["overlapped"])  # the reduce ran during the backward pass (engine grad_hook, page-locked copies)
    assert g["ranks"].tobytes() == g["plain"].tobytes()  # overlapping the backward pass changes no bit
    assert bool(g["same_on_all_ranks"])
    ranks, one = g["ranks"].astype(np.float64), g["one"].astype(np.float64)
    assert np.linalg.norm(one) > 0
    assert np.linalg.norm(ranks - one) <= 1e-6 * np.linalg.norm(one)
    assert np.abs(ranks - one).max() <= 1e-6 * np.abs(one).max()
    assert abs(float(g["loss"]) - float(g["loss1"])) <= 1e-6 * abs(float(g["loss1"]))


@pytest.mark.parametrize("via", ["mpi", "shm"])
def test_reduce_adds_in_rank_order_on_every_rank(tmp_path, via):
    """Three ranks, buckets smaller than the vector: every rank gets (a0 + a1) + a2, bit for bit, through
    MPI messages or through shared memory."""
    code = f"""
import numpy as np
from mpi4py import MPI
from clgpt.training.dist import Dist
d = Dist(MPI.COMM_WORLD)
assert d.via == {via!r}
a = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) * 10.0 ** r for r in range(3)]
got = d.allreduce_sum(a[d.rank], bucket=97)
want = (a[0] + a[1]) + a[2]
assert got.tobytes() == want.tobytes(), (d.rank, np.abs(got - want).max())
half = Dist.allreduce_sum(d, a[d.rank], bucket=97, wire="bf16") if d.via == "mpi" else got
assert np.abs(half - want).max() <= 2 ** -7 * 3 * max(np.abs(x).max() for x in a)
assert d.allgather(got.tobytes()) == [got.tobytes()] * 3
import clgpt.training.dist
clgpt.training.dist.MIN_SLICE, d.threads = 16, 3  # the shared-memory sum in slices on 3 threads: the same bits
assert d.allreduce_sum(a[d.rank], bucket=97).tobytes() == want.tobytes()
"""
    r = subprocess.run([MPIEXEC, "-n", "3", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "CLGPT_REDUCE": via})
    assert r.returncode == 0, r.stderr


def test_two_rank_runs_are_bit_identical_and_match_one_rank(data, tmp_path):
    one = run_stage(**stage_args(data, tmp_path / "one", steps=6))
    for name in ("a", "b"):
        spec = {"mode": "stage", "args": stage_args(data, tmp_path / name, steps=6, ranks=2),
                "out": str(tmp_path / f"{name}.json")}
        r = mpirun(2, spec)
        assert r.returncode == 0, r.stderr
        assert "2 ranks (MPI)" in r.stderr and "rank 1 pid" in r.stderr
    assert (tmp_path / "a" / "model.ckpt").read_bytes() == (tmp_path / "b" / "model.ckpt").read_bytes()
    two = json.loads((tmp_path / "a.json").read_text())
    assert two["ranks"] == 2 and one["ranks"] == 1
    assert abs(two["final_loss"] - one["final_loss"]) <= 1e-4 * one["final_loss"]
    w1 = load_checkpoint(str(tmp_path / "one" / "model.ckpt"))["params"]
    w2 = load_checkpoint(str(tmp_path / "a" / "model.ckpt"))["params"]
    assert max(float(np.abs(w1[n] - w2[n]).max()) for n in w1) < 1e-4


def test_killed_rank_is_named_and_the_run_resumes(data, tmp_path):
    full = tmp_path / "full"
    r = mpirun(2, {"mode": "stage", "args": stage_args(data, full, steps=8, checkpoint_every=2, ranks=2),
                   "out": str(tmp_path / "full.json")})
    assert r.returncode == 0, r.stderr
    out = tmp_path / "killed"
    args = stage_args(data, out, steps=8, checkpoint_every=2, ranks=2)
    partial = args["ckpt_out"] + ".partial"
    r = mpirun(2, {"mode": "stage", "args": args, "kill": [1, 5], "out": str(tmp_path / "k.json")},
               launch="pretrain", partial=partial)
    assert r.returncode != 0
    assert_one_line(r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: pretrain: MPI rank 1 of 2 (pid ") and "run again to resume" in last, r.stderr
    assert not (out / "model.ckpt").exists()  # nothing that looks like the stage's output
    assert load_checkpoint(partial)["step"] == 4
    assert not list(out.glob(".pretrain-ranks-*"))  # the launcher's status folder is gone
    r = mpirun(2, {"mode": "stage", "args": args, "out": str(tmp_path / "resumed.json")})
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "resumed.json").read_text())["resumed_from"] == 4
    assert (out / "model.ckpt").read_bytes() == (full / "model.ckpt").read_bytes()


@pytest.mark.parametrize("sig, words", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM"),
                                         (signal.SIGHUP, "stopped by SIGHUP")], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_to_one_rank_saves_and_the_run_resumes(data, tmp_path, sig, words):
    """A signal to one rank (a cluster's time limit reaches the ranks one by one): every rank stops after the
    same step, rank 0 saves it, and one line says so; the re-run resumes there and ends with the bytes of an
    uninterrupted run."""
    full = tmp_path / "full"
    r = mpirun(2, {"mode": "stage", "args": stage_args(data, full, steps=8, checkpoint_every=100, ranks=2),
                   "out": str(tmp_path / "full.json")})
    assert r.returncode == 0, r.stderr
    out = tmp_path / "stopped"
    args = stage_args(data, out, steps=8, checkpoint_every=100, ranks=2)
    partial = args["ckpt_out"] + ".partial"
    r = mpirun(2, {"mode": "stage", "args": args, "kill": [1, 3, int(sig)], "out": str(tmp_path / "k.json")},
               launch="pretrain", partial=partial)
    assert r.returncode != 0
    # rank 1 asks after step 3; the ranks learn of it with step 4's gradients, finish that step and stop together
    assert load_checkpoint(partial)["step"] == 4
    assert f"pretrain: {words}; saved step 4 to {partial}; run again to resume" in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error: ")] == \
        [f"error: {words}; run snakemake again to resume"], r.stderr
    assert_one_line(r.stderr)
    assert not (out / "model.ckpt").exists()
    r = mpirun(2, {"mode": "stage", "args": args, "out": str(tmp_path / "resumed.json")})
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "resumed.json").read_text())["resumed_from"] == 4
    assert (out / "model.ckpt").read_bytes() == (full / "model.ckpt").read_bytes()


def test_python_error_on_one_rank_stops_all_and_names_it(data, tmp_path):
    args = stage_args(data, tmp_path / "bad", steps=4, ranks=2)
    args["devices"] = ["no-such-device"]
    r = mpirun(2, {"mode": "stage", "args": args, "out": str(tmp_path / "x.json")}, launch="pretrain",
               partial=args["ckpt_out"] + ".partial")
    assert r.returncode != 0
    assert_one_line(r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    # the launcher's line names the rank, the world and the error (the rank's own `error: pretrain: rank r of 2`
    # line is printed too, unless MPI_Abort tears the output down before the launcher receives it)
    assert re.match(r"error: pretrain: MPI rank [01] of 2 \(pid \d+ on .*\) failed: OpenCL device 'no-such-device' "
                    r"not found", last), r.stderr
    assert not (tmp_path / "bad" / "model.ckpt").exists()


def test_a_two_rank_partial_resumes_with_one_rank(data, tmp_path):
    args = stage_args(data, tmp_path / "run", steps=8, checkpoint_every=2, ranks=2)
    r = mpirun(2, {"mode": "stage", "args": args, "kill": [0, 5], "out": str(tmp_path / "x.json")})
    assert r.returncode != 0
    assert load_checkpoint(args["ckpt_out"] + ".partial")["extra"]["ranks"] == 2
    one = run_stage(**{**args, "settings": settings(steps=8, checkpoint_every=2)})
    assert one["resumed_from"] == 4 and one["ranks"] == 1


def test_ranks_without_mpi_launch_is_a_clear_error(data, tmp_path):
    with pytest.raises(ClgptError, match=r"pretrain.ranks=2 but this process is one of 1 MPI rank.*mpiexec -n 2"):
        run_stage(**stage_args(data, tmp_path, ranks=2))
    with pytest.raises(ClgptError, match="pretrain.ranks=5 is more than batch_size=4"):
        run_stage(**stage_args(data, tmp_path, ranks=5))


@pytest.mark.parametrize("output,pid_of_1,want", [
    ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID 4242 RUNNING AT vm\n=   EXIT CODE: 9\n"
     "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)", 4242, 1),  # MPICH
    ("mpiexec noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).", 77, 1),  # Open MPI
    ("something else went wrong", 77, None),
])
def test_launcher_names_the_failed_rank(output, pid_of_1, want):
    ranks = {0: {"rank": 0, "pid": 1}, 1: {"rank": 1, "pid": pid_of_1}}
    assert culprit(output, ranks)[0] == want
    assert culprit(output, {0: {"rank": 0, "pid": 1}, 1: {"rank": 1, "pid": 2, "error": "boom"}}) == (1, "boom")


def _wait_until(done, what: str, timeout: float = 60) -> None:
    """Waits for an event (the watcher's state shows it), not for a time: a busy machine may take longer."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.01)  # the period of the look, not a wait for the event


@pytest.mark.parametrize("finished", [False, True])
def test_first_rank_to_end_is_named_before_the_launchers_report(tmp_path, finished):
    """The launcher kills the other ranks after the first dies and may report one of those (MPICH names one
    pid); the wrapper names the rank whose process ended first, unless that rank had finished its work."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        for r, p in enumerate(procs):
            rec = {"rank": r, "size": 2, "pid": p.pid, "host": socket.gethostname(), "finished": finished and r == 1}
            (tmp_path / f"rank{r}.json").write_text(json.dumps(rec))
        watch = FirstToEnd(str(tmp_path))
        _wait_until(lambda: len(watch._fds) == 2, "the watcher holds both ranks' pidfds")
        procs[1].kill()
        procs[1].wait()
        _wait_until(lambda: 1 in watch._done if finished else watch.rank is not None, "the watcher saw rank 1 end")
        procs[0].kill()
        procs[0].wait()
        _wait_until(lambda: watch.rank is not None, "the watcher named a rank")
        first = watch.stop(2)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert first == (0 if finished else 1)
    reported = "=   PID %d RUNNING AT vm\n=   EXIT CODE: 9\n" % procs[0].pid  # the launcher names rank 0
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    assert culprit(reported, ranks, first) == (first, "EXIT CODE: 9")
    assert culprit(reported, ranks, None)[0] == 0
    assert FirstToEnd(str(tmp_path)).stop(3) is None  # a rank it could not watch: the launcher's output decides


def test_two_rank_pipeline_runs_through_snakemakes_mpi_launch(local_sweep):
    """The rules' `{resources.mpi} -n {resources.tasks}` line, end to end on the tiny workflow: test_pipeline.SWEEP
    (pretrain and tune on 2 ranks, with a sweep) run by `snakemake --cores 2 model.gguf sweep` (tests/conftest.py)."""
    from test_pipeline import SWEEP

    assert SWEEP["pretrain"]["ranks"] == SWEEP["tune"]["ranks"] == 2
    for stage in ("pretrain", "tune"):
        log = (local_sweep / "logs" / f"{stage}.log").read_text()
        assert f"{stage}: 2 ranks (MPI), rows per rank [2, 2] of 4: rank 0 pid" in log
    assert (local_sweep / "model.gguf").stat().st_size > 0
    assert not list((local_sweep / "results").rglob("*.partial"))
