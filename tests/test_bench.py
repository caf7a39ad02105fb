"""`clgpt bench` on a tiny shape: it runs, checks its GEMM against numpy and ends with tokens/s=<n>.

No timing is asserted: the figures depend on the machine and on what else it runs.
"""

import re
import subprocess
import sys
from pathlib import Path

from clgpt.device.knobs import Knobs

ROOT = Path(__file__).resolve().parent.parent

TINY = ["--vocab", "300", "--ctx", "16", "--embd", "32", "--ffn", "64", "--heads", "2", "--layers", "1",
        "--batch", "2", "--steps", "2", "--gemm", "64"]


def test_bench_tiny_shape():
    proc = subprocess.run([sys.executable, "-m", "clgpt", "bench", *TINY], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    m = re.fullmatch(r"tokens/s=([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)", lines[-1])
    assert m, f"last line is {lines[-1]!r}"
    assert float(m.group(1)) > 0
    assert any(line.startswith("device: ") for line in lines), proc.stdout
    assert re.search(r"[0-9.]+ ms/step", proc.stdout), proc.stdout
    gemm = [line for line in lines if line.startswith("gemm 64^2")]
    assert gemm and re.search(r"OpenCL [0-9.]+ GFLOP/s, numpy [0-9.]+ GFLOP/s", gemm[0]), proc.stdout
    check = [line for line in lines if line.startswith("gemm check: ")]
    assert len(check) == 1 and check[0].startswith("gemm check: passed"), proc.stdout
    err = float(re.search(r"max rel err ([0-9.eE+-]+)", check[0]).group(1))
    assert err <= 1e-4


def test_bench_gemm_figure_against_numpy():
    """The GEMM path on a size that is no multiple of the tiles, checked in process."""
    from clgpt.bench import gemm_figure
    from clgpt.model import ModelConfig, init_params
    from clgpt.models.gpt2 import GPT2Engine as Engine

    cfg = ModelConfig(vocab_size=300, n_ctx=8, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    eng = Engine(cfg, init_params(cfg, 0), batch_size=1, seq_len=8, knobs=Knobs())
    g = gemm_figure(eng, 37)
    assert g["ok"] and g["err"] <= 1e-4
    assert g["cl"] > 0 and g["np"] > 0
