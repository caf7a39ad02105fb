"""The tiny pipeline and a 2-point sweep through `--profile profiles/slurm` on a real SLURM (single node): every stage
is a SLURM job that sacct lists with its rule and resources, and the models and the sweep summary are byte for byte
those of a local `snakemake --cores 2` run. Pretraining runs as 2 MPI ranks: under the profile they start through
`srun` (a 2-task job step), locally through mpiexec. Where no SLURM answers, the test session starts the single-node
one of `.ci/slurm.sh` itself (as root: it installs Debian's packages where they are missing) and stops it at the
end, so `pytest` alone is the whole set-up; where it cannot, this test fails: it is never skipped. Both runs
(test_pipeline.SWEEP: pretrain and tune on 2 ranks) start at the session's start (tests/conftest.py): the rest of
the suite runs while SLURM's status checks wait."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SLURM_SH = Path(__file__).resolve().parent.parent / ".ci" / "slurm.sh"


def slurm_is_up() -> str:
    """'' when a SLURM controller answers with an idle node and accounting, else what is missing."""
    for tool in ("sinfo", "sbatch", "sacct"):
        if not shutil.which(tool):
            return f"`{tool}` not found"
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if r.returncode or not re.search(r"idle|mix|alloc", r.stdout):
        return f"no SLURM node up (sinfo: {(r.stdout + r.stderr).strip()!r})"
    r = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=30)
    if r.returncode:
        return f"no SLURM accounting (sacct: {r.stderr.strip()!r})"
    return ""


def start_slurm() -> tuple[bool, str]:
    """Where no SLURM answers and this process is root, `.ci/slurm.sh start` (it installs what is missing and waits
    for the node) -> (whether it ran, so `stop_slurm` must follow; '' when a SLURM is up, else what is missing and
    what to do)."""
    missing = slurm_is_up()
    if not missing:
        return False, ""
    if os.geteuid() != 0:
        return False, f"{missing}; the tests start one only as root: run `bash {SLURM_SH} start` as root first"
    r = subprocess.run(["bash", str(SLURM_SH), "start"], capture_output=True, text=True, timeout=1800)
    if r.returncode:
        tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-5:])
        return True, f"`bash {SLURM_SH} start` failed (exit {r.returncode}): {tail}"
    missing = slurm_is_up()
    return True, missing and f"{missing}, after `bash {SLURM_SH} start`"


def stop_slurm() -> None:
    """Stops the SLURM that start_slurm started and removes its state (`.ci/slurm.sh stop`)."""
    subprocess.run(["bash", str(SLURM_SH), "stop"], capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def runs(local_sweep, slurm_sweep):
    """(local folder, cluster folder, the cluster run's output): both runs of test_pipeline.SWEEP, which
    tests/conftest.py starts at the session's start."""
    cluster, out = slurm_sweep
    return local_sweep, cluster, out


def test_every_stage_ran_as_a_slurm_job_with_its_resources(runs):
    _, _, out = runs
    run_id = re.search(r"SLURM run ID: (\S+)", out).group(1)
    job_ids = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    r = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids),
                        "--format=JobID,JobName,State,Comment,AllocCPUS,ReqMem,Timelimit"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    jobs = {}
    for line in r.stdout.splitlines():
        job_id, name, state, comment, cpus, mem, limit = line.split("|")
        assert name == run_id and state == "COMPLETED", line
        jobs[job_id] = (re.match(r"rule_(\w+?)(_wildcards_|$)", comment).group(1), cpus, mem, limit)
    assert sorted(jobs) == sorted(job_ids), (job_ids, r.stdout)
    rules = sorted(rule for rule, *_ in jobs.values())
    assert rules == sorted(["train_tokenizer", "encode", "pretrain", "tune", "evaluate", "export",
                            *["sweep_pretrain", "sweep_tune", "sweep_evaluate", "sweep_export"] * 2,
                            "sweep_summary"]), rules  # one tokenizer, one encode for everything
    for rule, cpus, mem, limit in jobs.values():
        if rule.endswith("pretrain") or rule.endswith("tune"):  # 2 ranks of 1 CPU
            assert (cpus, mem, limit) == ("2", "1500M", "00:20:00"), (rule, cpus, mem, limit)
        if rule.endswith("evaluate"):
            assert (cpus, mem, limit) == ("1", "1000M", "00:20:00"), (rule, cpus, mem, limit)


def test_mpi_stages_ran_their_ranks_through_srun(runs):
    _, cluster, out = runs
    job_ids = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    r = subprocess.run(["sacct", "-n", "-P", "-j", ",".join(job_ids), "--format=JobID,JobName,NTasks,State,Comment"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines()]
    mpi_jobs = {job for job, _, _, _, comment in rows if re.match(r"rule_(sweep_)?(pretrain|tune)", comment)}
    assert len(mpi_jobs) == 6, r.stdout  # pretrain and tune: the pipeline's and each sweep run's
    for job in mpi_jobs:  # each job has one srun step of 2 tasks: the ranks
        # the step is named after the interpreter the rule's shell runs (python, python3, python3.11, ...)
        steps = [(re.sub(r"^python[\d.]*$", "python", name), ntasks, state)
                 for jid, name, ntasks, state, _ in rows if re.fullmatch(job + r"\.\d+", jid)]
        assert steps == [("python", "2", "COMPLETED")], (job, r.stdout)
    for stage in ("pretrain", "tune"):
        log = (cluster / "logs" / f"{stage}.log").read_text()
        assert f"{stage}: 2 ranks (MPI)" in log and "rank 1 pid" in log, log[-2000:]


def test_cluster_results_equal_the_local_run(runs):
    local, cluster, _ = runs
    for f in ("model.gguf", "models/lr-0.003.gguf", "models/lr-0.001.gguf", "results/pretrain/model.ckpt",
              "results/sweep/lr-0.001/tune/model.ckpt", "results/sweep/summary.csv"):
        assert (cluster / f).read_bytes() == (local / f).read_bytes(), f
    assert (cluster / "models/lr-0.003.gguf").read_bytes() == (cluster / "model.gguf").read_bytes()
    assert (cluster / "models/lr-0.003.gguf").read_bytes() != (cluster / "models/lr-0.001.gguf").read_bytes()
    summary = (cluster / "results/sweep/summary.md").read_text()
    assert "| lr-0.003 |" in summary and "| lr-0.001 |" in summary
