"""Sweeps and per-rule resources, without a cluster: the sweep's runs, names and shared stages, its one-line errors,
the ranking, and that config.yaml's `resources:` is what each planned job asks for. (tests/test_slurm.py runs the
same sweep through SLURM.)"""

import copy
import json
import re
import subprocess
import sys

import pytest

from clgpt.config import validate_config
from clgpt.errors import ClgptError
from clgpt.training.sweep import run_name, summarize, sweep_runs, varied_stages
from test_pipeline import SWEEP, TINY, make_workdir, one_line_error, write_config


def planned_jobs(path, *targets):
    """{rule: job count} that `snakemake -n TARGETS` plans, and the dry run's text."""
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", *targets], cwd=path,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    stats = out.split("Job stats:")[1].split("total")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", stats, re.M)}, out


def with_sweep(sweep: dict, config: dict = TINY) -> dict:
    c = copy.deepcopy(config)
    c["sweep"] = sweep
    return c


def test_every_combination_is_a_run_with_its_own_validated_config():
    runs = sweep_runs(validate_config(with_sweep({"pretrain.lr": [0.001, 0.003], "model.n_layer": [1, 2]})))
    assert list(runs) == ["lr-0.001_n_layer-1", "lr-0.001_n_layer-2", "lr-0.003_n_layer-1", "lr-0.003_n_layer-2"]
    run = runs["lr-0.003_n_layer-2"]
    assert run["overrides"] == {"pretrain.lr": 0.003, "model.n_layer": 2}
    assert run["config"]["pretrain"]["lr"] == 0.003 and run["config"]["model"]["n_layer"] == 2
    assert run["config"]["pretrain"]["steps"] == TINY["pretrain"]["steps"]  # the rest is the base config
    assert run["config"]["tune"]["lr"] == 0.002  # schema default filled in


def test_a_sweep_over_the_optimizer_and_a_muon_setting():
    runs = sweep_runs(validate_config(with_sweep({"pretrain.optimizer": ["adamw", "muon"],
                                                  "pretrain.muon.lr": [0.01, 0.04]})))
    assert list(runs) == ["optimizer-adamw_muon.lr-0.01", "optimizer-adamw_muon.lr-0.04",
                          "optimizer-muon_muon.lr-0.01", "optimizer-muon_muon.lr-0.04"]
    s = runs["optimizer-muon_muon.lr-0.04"]["config"]["pretrain"]
    assert s["optimizer"] == "muon" and s["muon"]["lr"] == 0.04
    assert s["muon"]["momentum"] == 0.95  # the group's other keys keep their defaults


def test_run_names_keep_the_section_only_where_two_keys_share_a_name():
    assert run_name({"pretrain.lr": 0.001, "tune.lr": 0.002}) == "pretrain.lr-0.001_tune.lr-0.002"
    assert run_name({"model.tied": False, "export.type": "q8_0"}) == "tied-false_type-q8_0"


def test_stages_no_swept_key_touches_are_shared():
    assert varied_stages({"pretrain.lr": [1], "model.n_layer": [1]}) == {"pretrain", "tune", "eval"}
    assert varied_stages({"tune.lr": [1]}) == {"tune", "eval"}
    assert varied_stages({"export.type": ["f16"]}) == set()
    assert varied_stages({"model.n_ctx": [256]}) == {"encoded", "pretrain", "tune", "eval"}
    assert varied_stages({"tokenizer.vocab_size": [300]}) == {"tokenizer", "encoded", "pretrain", "tune", "eval"}


@pytest.mark.parametrize(
    "sweep, message",
    [
        ({"pretrain.lrate": [0.1]}, ["config.yaml: unknown sweep key 'sweep.pretrain.lrate'; sweep keys are section.key"]),
        ({"lr": [0.1]}, ["unknown sweep key 'sweep.lr'"]),
        ({"resources.pretrain": [{}]}, ["sweep.resources.pretrain cannot be swept"]),
        ({"pretrain.ranks": [1, 2]}, ["sweep.pretrain.ranks cannot be swept"]),
        ({"corpus.nope": [1]}, ["unknown sweep key 'sweep.corpus.nope'"]),
        ({"pretrain.lr": []}, ["config.yaml: sweep.pretrain.lr is an empty list; give at least one value or remove the key"]),
        ({"pretrain.lr": 0.1}, ["sweep.pretrain.lr", "0.1"]),  # the schema says: not a list
        ({"pretrain.lr": [-1.0]}, ["(sweep run lr--1.0)", "pretrain.lr", "-1.0"]),
        ({"model.n_head": [3]}, ["(sweep run n_head-3)", "model.n_head=3"]),
    ],
)
def test_bad_sweep_is_a_one_line_error_naming_it(sweep, message):
    with pytest.raises(ClgptError) as e:
        sweep_runs(validate_config(with_sweep(sweep)))
    assert all(part in str(e.value) for part in message), str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_sweep_key_stops_snakemake_before_any_job(tmp_path):
    path = make_workdir(tmp_path / "bad", with_sweep({"pretrain.lr": [0.001], "pretrain.drop_out": [0.1]}))
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "sweep"], cwd=path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode != 0
    assert "error: config.yaml: unknown sweep key 'sweep.pretrain.drop_out'" in one_line_error(r.stdout + r.stderr)
    assert not (path / "results").exists()


def test_dry_run_plans_one_tokenizer_and_one_encode_for_a_training_sweep(tmp_path):
    path = make_workdir(tmp_path / "wf", with_sweep({"pretrain.lr": [0.001, 0.003], "model.n_layer": [1, 2],
                                                      "tune.warmup_steps": [1, 2]}))
    jobs, out = planned_jobs(path, "sweep")
    assert jobs["train_tokenizer"] == 1 and jobs["encode"] == 1
    assert "sweep_train_tokenizer" not in jobs and "sweep_encode" not in jobs
    for rule in ("sweep_pretrain", "sweep_tune", "sweep_evaluate", "sweep_export"):
        assert jobs[rule] == 8, (rule, jobs)
    assert jobs["sweep_summary"] == 1
    assert "models/n_layer-2_lr-0.003_warmup_steps-1.gguf" in out  # keys in config order (sorted by the dump)


def test_a_tune_sweep_shares_the_pretrained_model_and_a_vocab_sweep_shares_nothing(tmp_path):
    path = make_workdir(tmp_path / "wf", with_sweep({"tune.lr": [0.001, 0.002]}))
    jobs, _ = planned_jobs(path, "sweep")
    assert jobs["pretrain"] == 1 and "sweep_pretrain" not in jobs and jobs["sweep_tune"] == 2
    write_config(path, with_sweep({"tokenizer.vocab_size": [300, 320]}))
    jobs, _ = planned_jobs(path, "sweep")
    assert jobs["sweep_train_tokenizer"] == 2 and jobs["sweep_encode"] == 2 and "train_tokenizer" not in jobs


def test_each_job_asks_for_the_resources_config_gives_its_stage(tmp_path):
    config = copy.deepcopy(TINY)
    config["resources"] = {"pretrain": {"threads": 2, "mem_mb": 1234, "runtime": 77, "gpu": 1},
                           "evaluate": {"mem_mb": 4321, "gpu": 2}}
    path = make_workdir(tmp_path / "wf", with_sweep({"pretrain.lr": [0.001]}, config))
    _, out = planned_jobs(path, "model.gguf", "sweep", "--resources", "gpu=2")
    jobs = {m.group(1): m.group(2) for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", out, re.M | re.S)}
    for rule in ("pretrain", "sweep_pretrain"):
        assert re.search(r"threads: 2\b", jobs[rule]) and "runtime=77" in jobs[rule], jobs[rule]
        assert "mem_mb=1234" in jobs[rule] and "gpu=1" in jobs[rule], jobs[rule]
    for rule in ("evaluate", "sweep_evaluate"):
        assert "mem_mb=4321" in jobs[rule] and "gpu=2" in jobs[rule] and "runtime=60" in jobs[rule], jobs[rule]
    assert "mem_mb=2000" in jobs["train_tokenizer"] and "gpu=" not in jobs["train_tokenizer"]


def test_summary_ranks_runs_by_heldout_loss(tmp_path):
    runs, metrics, logs = {}, {}, {}
    for name, lr, loss in (("lr-0.1", 0.1, 4.5), ("lr-0.01", 0.01, 3.25), ("lr-0.001", 0.001, 3.75)):
        runs[name] = {"overrides": {"pretrain.lr": lr}}
        metrics[name] = tmp_path / f"{name}.json"
        metrics[name].write_text(json.dumps({
            "heldout": {"pretrain": {"loss_pretrained": loss + 1, "loss_tuned": loss + 2},
                        "tune": {"loss_pretrained": loss + 3, "loss_tuned": loss}},
            "exact_match": {"tune": {"rate": 0.5}, "heldout": {"rate": 0.0}}, "num_params": 1000}))
        logs[name] = tmp_path / f"{name}.csv"
        logs[name].write_text("step,loss,lr\n1,5.0,0.1\n2,4.0,0.1\n")
    out = {k: str(tmp_path / f"summary.{k}") for k in ("csv", "md", "png")}
    rows = summarize(runs, metrics, logs, out["csv"], out["md"], out["png"])
    assert [r["run"] for r in rows] == ["lr-0.01", "lr-0.001", "lr-0.1"]
    csv_lines = open(out["csv"]).read().splitlines()
    assert csv_lines[0].startswith("rank,run,pretrain.lr,tune_heldout_loss,pretrain_heldout_loss")
    assert csv_lines[1].startswith("1,lr-0.01,0.01,3.25,5.25")
    md = open(out["md"]).read()
    assert "ranked by held-out loss on tune dialogs" in md and "Best: `lr-0.01` -> `models/lr-0.01.gguf`" in md
    assert open(out["png"], "rb").read(4) == b"\x89PNG"


def test_sweep_target_without_a_sweep_section_says_what_to_add():
    with pytest.raises(ClgptError, match="no sweep: section; add lists of values"):
        summarize({}, {}, {}, "a.csv", "a.md", "a.png")


def test_a_local_sweep_runs_every_stage_and_its_default_run_is_the_pipelines_model(local_sweep):
    # a real run, not a plan: the sweep rules must hand each stage script every input it reads
    # (`snakemake --cores 2 model.gguf sweep` on test_pipeline.SWEEP, started by tests/conftest.py)
    names = list(sweep_runs(SWEEP))
    assert names[0] == "lr-0.003" and SWEEP["pretrain"]["lr"] == 0.003  # the first run is the pipeline's own model
    assert sorted(p.name for p in (local_sweep / "models").glob("*.gguf")) == sorted(f"{n}.gguf" for n in names)
    assert (local_sweep / "models" / f"{names[0]}.gguf").read_bytes() == (local_sweep / "model.gguf").read_bytes()
    assert (local_sweep / "results" / "sweep" / "summary.csv").exists()
