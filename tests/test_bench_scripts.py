"""bench/gpu.sh, the NVIDIA device calls: its usage lists every subcommand, each subcommand reaches its function
(GPU_SH_DRY=1, nothing sourced or run), and every `bench/gpu.sh X` the docs and results quote names one of them."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.sh"
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "bench").glob("*.md")), *sorted((ROOT / "bench").glob("*.py")), ROOT / "bench" / "gpu_env.sh"]


def gpu_sh(*args: str, dry: bool = False) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"GPU_SH_DRY": "1"} if dry else {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=30)


def subcommands() -> list[str]:
    """The subcommands gpu.sh defines (its cmd_* functions), in its spelling (dashes)."""
    return [f.replace("_", "-") for f in re.findall(r"^cmd_(\w+)\(\)", SCRIPT.read_text(encoding="utf-8"), re.M)]


@pytest.mark.parametrize("args", [(), ("nonsense",), ("char_speed",)])
def test_no_or_unknown_subcommand_prints_the_list_and_exits_2(args):
    run = gpu_sh(*args, dry=True)
    assert run.returncode == 2
    listed = re.findall(r"^  (\S+)", run.stderr, re.M)
    assert listed == subcommands() and len(listed) >= 10


@pytest.mark.parametrize("args", [("suite",), ("suite", "quick"), ("ratio",), ("peer",), ("flash",), ("arch",), ("tc",),
                                  ("wgmma",), ("char",), ("char-speed",), ("char-vocab",), ("muon",), ("mpi",),
                                  ("mpi", "one"), ("generic",), ("flash-portable",), ("gemm-forms",),
                                  ("products",)])
def test_each_subcommand_reaches_its_function(args):
    run = gpu_sh(*args, dry=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["gpu.sh:", "cmd_" + args[0].replace("-", "_"), *args[1:]]


@pytest.mark.parametrize("args", [("suite", "fast"), ("mpi", "two")])
def test_a_subcommand_refuses_an_argument_it_does_not_take(args):
    assert gpu_sh(*args, dry=True).returncode == 2


def test_quoted_commands_name_existing_subcommands():
    known = set(subcommands())
    quoted = [(page.name, sub) for page in PAGES
              for sub in re.findall(r"bash\s+bench/gpu\.sh\s+([\w-]+)", page.read_text(encoding="utf-8"))]
    assert len(quoted) >= 10
    for page, sub in quoted:
        assert sub in known, f"{page}: bench/gpu.sh {sub} is no subcommand of bench/gpu.sh"
    assert not [p.name for p in PAGES if "run_gpu" in p.read_text(encoding="utf-8")], "a page names a removed script"


def test_peer_ratio_pairs_clgpt_with_a_served_peer_and_checks_the_peer(tmp_path):
    """bench/peer_ratio.py (what `bash bench/gpu.sh peer` runs) off the GPU: the peer on the CPU, eager
    (--device cpu), at shape S. Its pairs, the peer's check against the minimal loop and the table come out;
    the figures themselves are not judged (a shared CPU)."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "peer_ratio.py"), "--device", "cpu", "--precision",
                          "fp32", "--shape", "S", "2", "", "--check", "S", "--reps", "2", "--warmup", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]  # 1: the check read FAILED
    table = (tmp_path / "peer_table.md").read_text()
    row = re.search(r"^\| S \| ([\d.]+), ([\d.]+) \| ([\d.]+) \(([\d.]+), ([\d.]+)\), ([\d.]+) .* \*\*([\d.]+)x\*\* \|$",
                    table, re.M)
    assert row, table
    clgpt_ms, torch_ms = float(row.group(1)), float(row.group(3))
    assert clgpt_ms > 0 and torch_ms > 0
    assert re.search(r"^- S: minimal check: (passed|FAILED) \(peer [\d.]+ ms/step, minimal loop [\d.]+", table, re.M)
    assert "failed:" not in table
    peer_log = (tmp_path / "torch_S.log").read_text()
    assert "eager, no torch.compile" in peer_log and peer_log.count("train:") == 2


def test_peer_ratio_ends_its_peers_when_terminated(tmp_path):
    """A timeout's SIGTERM to bench/peer_ratio.py ends the peers it started (left running they would share the GPU
    with the device call's next run): once the peer's log names its pid, TERM the script; the peer is gone when the
    script has exited."""
    import signal

    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "peer_ratio.py"), "--device", "cpu", "--precision",
                             "fp32", "--shape", "S", "2", "", "--compile-limit", "600", "--out", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    log, pid, deadline = tmp_path / "torch_S.log", None, time.monotonic() + 300
    try:
        while pid is None and proc.poll() is None and time.monotonic() < deadline:
            m = re.search(r"^pid (\d+)$", log.read_text(), re.M) if log.exists() else None
            pid = int(m.group(1)) if m else time.sleep(0.05)
        assert pid is not None, "the peer's log never named its pid"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"), "the peer outlived the script"


def test_peer_ratio_marks_the_pairs_whose_peer_the_host_paced():
    """bench/peer_ratio.py's table: a pair whose peer took at least HOST_BOUND of its step to issue it is marked
    (h), with a note under the table; a peer the GPU paced is not."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import peer_ratio
    finally:
        sys.path.pop(0)
    rows = {"GPT2S": [dict(clgpt=(26.6, 26.6), torch=(25.7, 25.7, 25.3)),
                      dict(clgpt=(26.7, 26.7), torch=(20.4, 20.3, 14.4))]}
    out = peer_ratio.table(rows, {}, "", [], {})
    assert re.search(r"^\| GPT2S \| .* \| 0\.966 \(h\), 0\.764 \| \*\*0\.865x\*\* \|$", out, re.M), out
    assert "- (h): the peer's host took at least 90% of its step" in out
    rows["GPT2S"].pop(0)
    out = peer_ratio.table(rows, {}, "", [], {})
    assert "(h)" not in out, out
