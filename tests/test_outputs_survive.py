"""No run leaves a user's file changed or gone: a stage that fails on a full disk (a small tmpfs, filled)
keeps the previous model.gguf, Modelfile and checkpoints byte for byte and says the disk is full; a folder
or a read-only folder in the way, or another snakemake running in the folder, stops the run before any job
with one line naming it."""

import errno
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clgpt.atomic import publish
from test_errors import one_line_error
from test_pipeline import ROOT, TINY, make_workdir, planned_rules, snakemake, write_config

KEPT = ("model.gguf", "Modelfile", "results/pretrain/model.ckpt", "results/pretrain/log.csv",
        "results/tune/model.ckpt", "results/tune/log.csv")


def digests(path: Path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in KEPT}


def test_publish_links_the_file_and_a_failed_publish_keeps_the_old_one(tmp_path):
    staged, published = tmp_path / "staging" / "model.gguf", tmp_path / "model.gguf"
    staged.parent.mkdir()
    staged.write_bytes(b"new")
    published.write_bytes(b"old")
    with pytest.raises(FileNotFoundError):
        publish(tmp_path / "staging" / "missing", published)
    assert published.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "staging"]
    publish(staged, published)
    assert published.read_bytes() == b"new"
    assert published.stat().st_ino == staged.stat().st_ino  # a link: no second copy on the disk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "staging"]  # no .tmp left


def test_each_publish_job_has_one_output():
    """Snakemake touches a job's outputs one by one, then fails it if an output is older than an input. A
    published file is its staged input's inode, so a job publishing two files fails whenever the two touches
    fall in different clock ticks (model.gguf touched, then Modelfile, which moves the staged Modelfile past
    model.gguf): one output a publish job."""
    text = (ROOT / "rules" / "publish.smk").read_text()
    rules = re.findall(r"^rule (\w+):\n(.*?)(?=^rule |\Z)", text, re.M | re.S)
    assert {name for name, _ in rules} >= {"publish_model", "publish"}
    for name, body in rules:
        outputs = re.search(r"^    output:\n((?:        .*\n)+)", body, re.M).group(1).strip().splitlines()
        assert len(outputs) == 1, f"rule {name}: {outputs}"


@pytest.mark.parametrize("write", ["checkpoint", "publish"])
def test_the_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch, write):
    """A rename that publishes a checkpoint or a model lives in the folder's entries: fsynced after it, it
    survives a power cut (as PyTorch's and Lightning's checkpoint writers do)."""
    import stat

    from clgpt.io.checkpoint import save_checkpoint
    from clgpt.model import ModelConfig, init_params

    events = []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(os, "replace", lambda a, b: (real_replace(a, b), events.append(("rename", str(b))))[0])

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("fsync folder", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / ("model.ckpt" if write == "checkpoint" else "model.gguf")
    if write == "checkpoint":
        cfg = ModelConfig(vocab_size=8, n_ctx=8, n_embd=8, n_head=2, n_layer=1, n_ff=16)
        save_checkpoint(str(target), cfg, init_params(cfg, 0), None, 0, None)
    else:
        (tmp_path / "staged").write_bytes(b"gguf")
        publish(tmp_path / "staged", target)
    assert events[-2:] == [("rename", str(target)), ("fsync folder", str(tmp_path))], events


def test_a_file_named_hf_stops_before_any_job(tmp_path):
    """`snakemake --cores 1 hf` writes the folder hf/: a file of that name is named, as model.gguf's folder is."""
    path = make_workdir(tmp_path / "wf")
    (path / "hf").write_text("mine\n")
    r = snakemake(path, "-n", "hf")
    assert r.returncode != 0
    assert one_line_error(r.stdout + r.stderr) == ("error: hf is a file, where the workflow writes a folder of "
                                                   "that name; move or rename the file and run again")
    assert (path / "hf").read_text() == "mine\n"


def test_sweep_without_a_sweep_section_is_one_line(tmp_path):
    path = make_workdir(tmp_path / "wf")
    r = snakemake(path, "-n", "sweep")
    assert r.returncode != 0
    assert "has none; add one" in one_line_error(r.stdout + r.stderr)
    assert "MissingInputException" not in r.stdout + r.stderr


def test_an_input_dated_in_the_future_is_named_before_any_job(tmp_path):
    """A clock that was wrong (or an archive from another machine) leaves a file dated in the future:
    Snakemake would fail every later run on its clock-skew check, in its words; clgpt names the file."""
    path = make_workdir(tmp_path / "wf")
    future = time.time() + 86400
    os.utime(path / "data/tune/en.jsonl", (future, future))
    r = snakemake(path, "-n", "model.gguf")
    assert r.returncode != 0
    line = one_line_error(r.stdout + r.stderr)
    assert line.startswith("error: data/tune/en.jsonl is dated in the future") and "touch data/tune/en.jsonl" in line
    os.utime(path / "data/tune/en.jsonl")  # what the line says to do
    assert snakemake(path, "-n", "model.gguf").returncode == 0


def test_published_file_is_stamped_now(tmp_path):
    """A link keeps the staged file's old time; the published name gets the time of publishing."""
    staged = tmp_path / "staged"
    staged.write_bytes(b"x")
    os.utime(staged, ns=(10**18, 10**18))
    before = time.time_ns()
    publish(staged, tmp_path / "published")
    assert (tmp_path / "published").stat().st_mtime_ns >= before - 10**7


# ---- a finished project on a small disk ------------------------------------------------------------

@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A 64 MiB tmpfs holding a finished tiny project (`snakemake --cores 1 model.gguf` ran there)."""
    mount = tmp_path_factory.mktemp("disk")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    assert r.returncode == 0, f"this test mounts a tmpfs to fill it (as root): {r.stderr}"
    try:
        path = make_workdir(mount / "wf")
        r = snakemake(path, "model.gguf")
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        yield path
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path, leave: int) -> Path:
    """A file that takes all but `leave` bytes of the disk holding `path`."""
    st = os.statvfs(path)
    filler = path.parent / "filler"
    with open(filler, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * (st.f_bavail * st.f_frsize - leave))
    return filler


def fail_on_a_full_disk(disk: Path, change, path: str) -> dict[str, str]:
    """Change the config, fill the disk to 64 KiB free and run: the run stops with one line saying the disk
    is full at `path`, and every file the user kept is unchanged. The digests of those files."""
    before = digests(disk)
    config = json.loads(json.dumps(TINY))
    change(config)
    write_config(disk, config)
    filler = fill(disk, 64 << 10)
    try:
        r = snakemake(disk, "model.gguf")
    finally:
        filler.unlink()
    assert r.returncode != 0
    line = one_line_error(r.stdout + r.stderr)
    assert f"error: {path}" in line and "the disk is full" in line and "free" in line, line
    assert digests(disk) == before  # every file the user had, byte for byte
    return before


def test_full_disk_export_keeps_the_previous_model(disk):
    try:
        before = fail_on_a_full_disk(disk, lambda c: c["export"].update(name="tiny2"), "results/staging/model.gguf")
        assert planned_rules(disk) == {"export"}  # with room again, the next run exports
    finally:
        write_config(disk, TINY)
    # The failed run's settings are Snakemake's record of the stage now: back on the old ones, it exports
    # again, the same bytes.
    r = snakemake(disk, "model.gguf")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert digests(disk) == before and planned_rules(disk) == set()


def test_export_names_the_space_it_needs(disk):
    """The size a full disk's message gives is the size of the GGUF a successful export writes."""
    config = json.loads(json.dumps(TINY))
    config["export"]["name"] = "tiny3"
    write_config(disk, config)
    size = (disk / "model.gguf").stat().st_size
    filler = fill(disk, 64 << 10)
    try:
        r = snakemake(disk, "model.gguf")
    finally:
        filler.unlink()
        write_config(disk, TINY)
    line = one_line_error(r.stdout + r.stderr)
    needed = float(line.split("needs about ")[1].split(" KiB")[0]) * 1024
    assert 0.95 * size < needed < 1.25 * size, (needed, size)


def test_folder_named_model_gguf_stops_before_any_job(disk):
    before = digests(disk)
    os.rename(disk / "model.gguf", disk / "model.gguf.kept")
    (disk / "model.gguf").mkdir()
    (disk / "model.gguf" / "notes.txt").write_text("mine\n")
    config = json.loads(json.dumps(TINY))
    config["export"]["name"] = "tiny2"
    write_config(disk, config)
    try:
        r = snakemake(disk, "model.gguf")
        assert r.returncode != 0
        assert "error: model.gguf is a folder" in one_line_error(r.stdout + r.stderr)
        assert (disk / "model.gguf" / "notes.txt").read_text() == "mine\n"
        assert hashlib.sha256((disk / "Modelfile").read_bytes()).hexdigest() == before["Modelfile"]
    finally:
        (disk / "model.gguf" / "notes.txt").unlink()
        (disk / "model.gguf").rmdir()
        os.rename(disk / "model.gguf.kept", disk / "model.gguf")
        write_config(disk, TINY)
    assert digests(disk) == before


def test_read_only_results_folder_is_named_before_any_job(disk):
    before = digests(disk)
    config = json.loads(json.dumps(TINY))
    config["tune"]["lr"] = 0.001
    write_config(disk, config)
    subprocess.run(["chattr", "+i", str(disk / "results" / "tune")], check=True)
    try:
        r = snakemake(disk, "model.gguf")
    finally:
        subprocess.run(["chattr", "-i", str(disk / "results" / "tune")], check=True)
        write_config(disk, TINY)
    assert r.returncode != 0
    line = one_line_error(r.stdout + r.stderr)
    assert "results/tune" in line and "read-only" in line, line
    assert digests(disk) == before


# ---- another run in the same folder ------------------------------------------------------------------

def test_second_run_in_the_same_folder_names_the_first(tmp_path):
    """A run holds its lock and is alive (a stand-in `snakemake` working in the folder): the second run
    names it and its pid, instead of Snakemake's advice to --rerun-incomplete its files."""
    path = make_workdir(tmp_path / "wf")
    (path / ".snakemake" / "locks").mkdir(parents=True)
    (path / ".snakemake" / "locks" / "0.output.lock").write_text(str(path / "model.gguf") + "\n")
    fake = tmp_path / "snakemake"
    fake.write_text("import time\ntime.sleep(120)\n")
    first = subprocess.Popen([sys.executable, str(fake)], cwd=path)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and str(fake) not in open(f"/proc/{first.pid}/cmdline").read():
            time.sleep(0.05)
        r = snakemake(path, "model.gguf")
        assert r.returncode != 0
        line = one_line_error(r.stdout + r.stderr)
        assert f"another snakemake (pid {first.pid}) is running in this folder" in line, line
        assert "rerun-incomplete" not in line.split(";")[0]
        assert first.poll() is None  # left alone
    finally:
        first.kill()
        first.wait()
    assert (path / ".snakemake" / "locks" / "0.output.lock").exists()


def test_disk_full_line_names_the_file_and_the_space():
    from clgpt.stage import os_error_line

    line = os_error_line(OSError(errno.ENOSPC, "No space left on device", "results/staging/pretrain/log.csv"))
    assert line.startswith("results/staging/pretrain/log.csv: the disk is full (the disk has ") and "free" in line


def test_full_disk_pretrain_keeps_the_previous_checkpoints(disk):
    """(Last in the module: the project's pretrain runs again on the next run.)"""
    try:
        fail_on_a_full_disk(disk, lambda c: c["pretrain"].update(steps=7), "results/staging/pretrain/")
        assert {"pretrain", "tune", "evaluate", "export"} <= planned_rules(disk)
    finally:
        write_config(disk, TINY)


def test_checkpoint_on_a_full_disk_names_the_space_it_needs(tmp_path):
    from clgpt.errors import ClgptError
    from clgpt.io.checkpoint import save_checkpoint
    from clgpt.model import ModelConfig, init_params

    mount = tmp_path / "small"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True)
    assert r.returncode == 0, f"this test mounts a tmpfs (as root): {r.stderr}"
    try:
        cfg = ModelConfig(vocab_size=512, n_ctx=64, n_embd=64, n_head=2, n_layer=1, n_ff=128)
        params = init_params(cfg, seed=0)
        size = sum(p.nbytes for p in params.values())
        path = mount / "model.ckpt.partial"
        with pytest.raises(ClgptError) as e:
            save_checkpoint(str(path), cfg, params, {}, 3, {})
        msg = str(e.value)
        assert msg.startswith(f"{path}: the disk is full (writing it needs about "), msg
        needed = float(msg.split("needs about ")[1].split(" KiB")[0]) * 1024
        assert size <= needed < 1.1 * size, (needed, size)
        assert os.listdir(mount) == []  # no partial file left taking the space
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
