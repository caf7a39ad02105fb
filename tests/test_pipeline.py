"""The whole workflow, end to end, on a tiny config: it runs, re-runs nothing when nothing changed, re-runs
only what a change touches, stops early on bad input, and gives the same bytes twice."""

import copy
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ALL_RULES = {"train_tokenizer", "encode", "pretrain", "tune", "evaluate", "export"}

TINY = {
    "device": "",
    "corpus": {"pretrain": "data/pretrain", "document": "line", "tune": "data/tune",
               "pretrain_heldout": "data/heldout/pretrain.txt", "tune_heldout": "data/heldout/tune.jsonl"},
    "tokenizer": {"vocab_size": 300},
    "model": {"n_ctx": 256, "n_embd": 32, "n_head": 2, "n_layer": 1, "n_ff": 64},
    "pretrain": {"steps": 6, "batch_size": 4, "seq_len": 32, "warmup_steps": 2, "checkpoint_every": 3},
    "tune": {"epochs": 0, "steps": 6, "batch_size": 4, "seq_len": 48, "warmup_steps": 2, "checkpoint_every": 3},
    "evaluate": {"max_tokens": 6},
    "export": {"type": "f32", "name": "tiny"},
}

# TINY + a 2-point sweep, pretrain and tune on 2 MPI ranks: run once locally and once through the SLURM profile
# (tests/conftest.py starts both at the session's start) for tests/test_sweep.py, tests/test_mpi.py and
# tests/test_slurm.py. lr-0.003 is the main pipeline's model again.
SWEEP = copy.deepcopy(TINY)
SWEEP["pretrain"].update(lr=0.003, ranks=2)
SWEEP["tune"]["ranks"] = 2
SWEEP["sweep"] = {"pretrain.lr": [0.003, 0.001]}
# small asks, so the 2-CPU SLURM test node runs the two sweep runs side by side
SWEEP["resources"] = {stage: {"threads": 1, "mem_mb": 1000, "runtime": 20}
                      for stage in ("train_tokenizer", "encode", "pretrain", "tune", "evaluate", "export")}
SWEEP["resources"]["pretrain"]["mem_mb"] = SWEEP["resources"]["tune"]["mem_mb"] = 1500  # 2 ranks


def default_signals() -> None:
    """preexec_fn of a child a test signals or types Ctrl-C at: the stop signals' default dispositions, whatever
    the suite inherited (a suite started in the background has SIGINT ignored, one under nohup SIGHUP)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


# a traceback, or Snakemake's failed-job block: what must never show beside (or after) clgpt's one line
BLOCK = ("Traceback", "RuleException", "CalledProcessError", "Error in rule", "WorkflowError", "Exiting because")


def assert_one_line(text: str) -> None:
    """Fails when a run's output shows a traceback or any part of Snakemake's failed-job block."""
    for block in BLOCK:
        assert block not in text, text


def one_line_error(text: str) -> str:
    """The single `error: ...` line of a failed run's output; fails on a traceback, on Snakemake's failed-job
    block, or on none/several."""
    assert_one_line(text)
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, text
    return lines[0]


def make_workdir(path: Path, config: dict = TINY) -> Path:
    """A copy of the workflow with a small corpus cut from data/ and the tiny config."""
    path.mkdir(parents=True)
    for name in ("Snakefile", "rules", "scripts", "kernels", "clgpt", "schemas", "envs", "report"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, path / name)
    for sub in ("pretrain", "tune", "heldout"):
        (path / "data" / sub).mkdir(parents=True)
    for f in ("pretrain/en.txt", "pretrain/ru.txt", "tune/en.jsonl", "tune/ru.jsonl", "heldout/pretrain.txt",
              "heldout/tune.jsonl"):
        lines = (ROOT / "data" / f).read_text(encoding="utf-8").splitlines()
        (path / "data" / f).write_text("\n".join(lines[:12]) + "\n", encoding="utf-8")
    write_config(path, config)
    return path


def write_config(path: Path, config: dict) -> None:
    (path / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")


def snakemake(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", *args],
        cwd=path, capture_output=True, text=True, timeout=900,
    )


def planned_rules(path: Path, *args: str) -> set[str]:
    """Rules a dry run would execute."""
    r = snakemake(path, "-n", *args, "model.gguf")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    if "Nothing to be done" in out:
        return set()
    stats = out.split("Job stats:")[1].split("total")[0]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+\s*$", stats, re.M)} & ALL_RULES


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two copies of the tiny workflow, each run by `snakemake model.gguf`, side by side (each stage is mostly one
    thread: the two runs share the CPU's cores). The first is the `workdir` the tests look at and change; the
    second is there for test_same_config_gives_same_bytes."""
    base = tmp_path_factory.mktemp("wf")
    paths = [make_workdir(base / name) for name in ("run", "again")]
    procs = []
    for path in paths:
        with open(path.with_name(path.name + ".out"), "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", "model.gguf"],
                                          cwd=path, stdout=out, stderr=subprocess.STDOUT))
    for path, proc in zip(paths, procs):
        assert proc.wait(timeout=900) == 0, path.with_name(path.name + ".out").read_text()[-6000:]
    return paths


@pytest.fixture(scope="module")
def workdir(runs):
    return runs[0]


def test_pipeline_writes_every_output(workdir):
    for f in ("model.gguf", "Modelfile", "results/tokenizer/tokenizer.json", "results/tokenizer/vocab.txt",
              "results/encoded/pretrain.bin", "results/encoded/pretrain.json", "results/pretrain/model.ckpt",
              "results/pretrain/log.csv", "results/tune/model.ckpt", "results/tune/log.csv",
              "results/eval/metrics.json", "results/eval/report.md", "results/eval/loss_tune.png",
              "logs/pretrain.log", "benchmarks/pretrain.tsv"):
        assert (workdir / f).stat().st_size > 0, f
    assert (workdir / "model.gguf").read_bytes()[:4] == b"GGUF"
    assert "num_ctx 256" in (workdir / "Modelfile").read_text()
    metrics = json.loads((workdir / "results/eval/metrics.json").read_text())
    assert "forgetting" in json.dumps(metrics)
    lines = (workdir / "results/pretrain/log.csv").read_text().splitlines()
    assert lines[0].startswith("step,loss,lr") and len(lines) == 1 + TINY["pretrain"]["steps"]


def test_nothing_changed_does_no_work(workdir):
    """Not even a publish job (planned_rules counts only the stages)."""
    r = snakemake(workdir, "-n", "model.gguf")
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_workflow_profile_publishes_without_spawning_a_process(workdir):
    """Under profiles/default a publish job's `run:` block runs in Snakemake's own process: spawned, each of the
    default run's six would start a process that parses the workflow again (about 3 s each). Snakemake's
    --verbose names every job it spawns. The republished Modelfile is the one the stage staged."""
    before = (workdir / "Modelfile").read_bytes()
    shutil.copytree(ROOT / "profiles", workdir / "profiles")
    try:
        (workdir / "Modelfile").unlink()
        r = snakemake(workdir, "--verbose", "Modelfile")
    finally:
        shutil.rmtree(workdir / "profiles")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "localrule publish:" in out and "spawned job" not in out, out[-3000:]
    assert (workdir / "Modelfile").read_bytes() == before


def test_tune_change_reruns_only_downstream(workdir):
    changed = json.loads(json.dumps(TINY))
    changed["tune"]["lr"] = 0.001
    write_config(workdir, changed)
    try:
        assert planned_rules(workdir) == {"tune", "evaluate", "export"}
    finally:
        write_config(workdir, TINY)
    assert planned_rules(workdir, "--forcerun", "tune") == {"tune", "evaluate", "export"}


def test_export_type_change_reruns_only_export(workdir):
    changed = json.loads(json.dumps(TINY))
    changed["export"]["type"] = "f16"
    write_config(workdir, changed)
    try:
        assert planned_rules(workdir) == {"export"}
    finally:
        write_config(workdir, TINY)


def test_kernel_edit_reruns_the_stages_that_use_it(workdir):
    kernel = workdir / "kernels" / "gelu.cl"
    original = kernel.read_bytes()
    kernel.write_bytes(original + b"\n// edited\n")
    try:
        assert planned_rules(workdir) == {"pretrain", "tune", "evaluate", "export"}
    finally:
        kernel.write_bytes(original)


@pytest.mark.parametrize(
    "module, rules",
    [("clgpt/device/tuning.py", {"pretrain", "tune", "evaluate", "export"}),  # imported by the engine only
     ("clgpt/io/gguf.py", {"export"})],
)
def test_module_edit_reruns_the_stages_that_import_it(workdir, module, rules):
    """Code inputs come from each script's import graph: an edit to any module it imports re-plans it."""
    path = workdir / module
    original = path.read_bytes()
    path.write_bytes(original + b"\n# edited\n")
    try:
        assert planned_rules(workdir) == rules
    finally:
        path.write_bytes(original)


def test_same_config_gives_same_bytes(runs):
    workdir, again = runs
    for f in ("model.gguf", "results/tokenizer/tokenizer.json", "results/pretrain/model.ckpt",
              "results/tune/model.ckpt"):
        assert (again / f).read_bytes() == (workdir / f).read_bytes(), f


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda p: write_config(p, {**TINY, "tune": {**TINY["tune"], "lr_rate": 1}}), "unknown key 'tune.lr_rate'"),
        (lambda p: [f.unlink() for f in (p / "data/tune").glob("*.jsonl")], "data/tune: no *.jsonl files"),
        (lambda p: write_config(p, {**TINY, "device": "no-such-device"}), "no-such-device"),
        (lambda p: write_config(p, {**TINY, "model": {**TINY["model"], "n_embd": 31}}), "model.n_embd=31 is not divisible"),
        (lambda p: (p / "data/pretrain/en.txt").write_bytes(b"ok\n\xc3\x28 bad\n"), "not UTF-8 at byte offset 3"),
        (lambda p: (p / "data/tune/en.jsonl").write_text('{"user": "hi"}\n'), 'en.jsonl:1: missing or empty "assistant"'),
    ],
)
def test_bad_input_stops_early_and_leaves_no_output(tmp_path, breakage, message):
    path = make_workdir(tmp_path / "bad")
    breakage(path)
    r = snakemake(path, "model.gguf")
    assert r.returncode != 0
    assert message in one_line_error(r.stdout + r.stderr)
    assert not (path / "model.gguf").exists()
    leftovers = [p for p in (path / "results").rglob("*") if p.is_file()] if (path / "results").exists() else []
    assert leftovers == []


def test_llama_cpp_answers_like_the_evaluation(workdir):
    """The exported GGUF, run by llama.cpp through its own chat template, gives the evaluation's answers."""
    sys.path.insert(0, str(ROOT / "bench"))
    from llama_exact_match import chat_answers

    metrics = json.loads((workdir / "results/eval/metrics.json").read_text())
    rows = metrics["answers"]["tune"][:6]
    got = chat_answers(str(workdir / "model.gguf"), [r["user"] for r in rows], TINY["evaluate"]["max_tokens"])
    assert got == [r["answer"] for r in rows]


def test_workflow_lint_is_clean():
    r = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert "Congratulations, your workflow is in a good condition!" in r.stdout + r.stderr, r.stdout + r.stderr


def test_llama_moe_pipeline_end_to_end(tmp_path):
    """`model.arch: llama` with 4 experts, 2 used per token: the whole workflow, then llama.cpp."""
    config = json.loads(json.dumps(TINY))
    config["model"] = {"arch": "llama", "n_ctx": 128, "n_embd": 32, "n_head": 2, "n_layer": 1, "n_ff": 64,
                       "n_expert": 4, "n_expert_used": 2}
    path = make_workdir(tmp_path / "moe", config)
    r = snakemake(path, "model.gguf")
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = json.loads((path / "results/eval/metrics.json").read_text())
    assert len(metrics["expert_usage"]) == 1 and len(metrics["expert_usage"][0]) == 4
    sys.path.insert(0, str(ROOT / "bench"))
    from llama_exact_match import chat_answers

    rows = metrics["answers"]["tune"][:4]
    got = chat_answers(str(path / "model.gguf"), [r["user"] for r in rows], TINY["evaluate"]["max_tokens"])
    assert got == [r["answer"] for r in rows]
