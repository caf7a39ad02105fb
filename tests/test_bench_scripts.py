"""bench/gpu.sh, the NVIDIA device calls: its usage lists every subcommand, each subcommand reaches its function
(GPU_SH_DRY=1, nothing sourced or run), and every `bench/gpu.sh X` the docs and results quote names one of them."""

import re
import subprocess
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


@pytest.mark.parametrize("args", [("suite",), ("suite", "quick"), ("ratio",), ("flash",), ("arch",), ("tc",),
                                  ("wgmma",), ("char",), ("char-speed",), ("char-vocab",), ("muon",), ("mpi",),
                                  ("mpi", "one")])
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
