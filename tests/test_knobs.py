"""clgpt.device.knobs: every CLGPT_* knob parsed in one place, at call time, into its typed field."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from clgpt.device import knobs
from clgpt.errors import ClgptError
from clgpt.device.knobs import OFF, Knobs

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = {"CLGPT_RANK_DIR"}  # how clgpt.training.launch and its ranks find their status folder, not a knob
PASSED_IN = {"wgmma_min_mnk", "gemm_tuning", "flash_tuning", "rows_tuning"}  # fields that change results: code passes them in, no variable sets them


def var(field: dataclasses.Field) -> str:
    return "CLGPT_" + field.name.upper()


def test_an_empty_environment_gives_the_dataclass_defaults():
    assert knobs.read({}) == Knobs()


def test_read_takes_os_environ_when_called(monkeypatch):
    monkeypatch.setenv("CLGPT_LAUNCH", "gpu")
    assert knobs.read().launch == "gpu"
    monkeypatch.setenv("CLGPT_LAUNCH", "cpu")
    assert knobs.read().launch == "cpu"


@pytest.mark.parametrize("variable, value, field, want", [
    ("CLGPT_LAUNCH", " NVIDIA ", "launch", "nvidia"),
    ("CLGPT_MATMUL", "kernel=matmul_rb,RM=6,NV=2,VW=8,lsize=1x4", "matmul",
     dict(kernel="matmul_rb", RM=6, NV=2, VW=8, lsize=(1, 4))),
    ("CLGPT_MATMUL_KEEP_SMALL", "1", "matmul_keep_small", True),
    ("CLGPT_MMA", "BM=32,BN=32,WM=2,WN=2", "mma", dict(BM=32, BN=32, WM=2, WN=2)),
    ("CLGPT_MMA_SMALL", "BM=32,BN=16,WM=1,WN=1", "mma_small", dict(BM=32, BN=16, WM=1, WN=1)),
    ("CLGPT_BF16", "off", "bf16", OFF),
    ("CLGPT_BF16", "BM=64,BN=64,WM=2,WN=2,STAGES=2", "bf16", dict(BM=64, BN=64, WM=2, WN=2, STAGES=2)),
    ("CLGPT_BF16_SMALL", "BM=32,BN=32,WM=1,WN=1,STAGES=2", "bf16_small", dict(BM=32, BN=32, WM=1, WN=1, STAGES=2)),
    ("CLGPT_WGMMA", "off", "wgmma", OFF),
    ("CLGPT_WGMMA", "BM=128,BN=256,STAGES=4,PIPE=1", "wgmma", dict(BM=128, BN=256, STAGES=4, PIPE=1)),
    ("CLGPT_WGMMA_NARROW", "BM=128,BN=64,STAGES=3,PIPE=1", "wgmma_narrow", dict(BM=128, BN=64, STAGES=3, PIPE=1)),
    ("CLGPT_WGMMA_MID", "off", "wgmma_mid", OFF),
    ("CLGPT_WGMMA_MID", "BM=128,BN=96,STAGES=4,PIPE=1", "wgmma_mid", dict(BM=128, BN=96, STAGES=4, PIPE=1)),
    ("CLGPT_FLASH", "FWD_MT=2,KS=32", "flash", dict(FWD_MT=2, KS=32)),
    ("CLGPT_PRESET", "0", "preset", 0),
    ("CLGPT_SUBGROUP", "off", "subgroup", 0),
    ("CLGPT_SUBGROUP", "16", "subgroup", 16),
    ("CLGPT_MMA_EMULATE", "1", "mma_emulate", True),
    ("CLGPT_WGMMA_EMULATE", "1", "wgmma_emulate", True),
    ("CLGPT_NV_VERBOSE", "1", "nv_verbose", True),
    ("CLGPT_SM90A_VERBOSE", "1", "sm90a_verbose", True),
    ("CLGPT_BENCH_PROFILE", "1", "bench_profile", True),
    ("CLGPT_REDUCE", "mpi", "reduce", "mpi"),
    ("CLGPT_REDUCE_THREADS", "4", "reduce_threads", 4),
])
def test_each_variable_sets_its_field_alone(variable, value, field, want):
    got = knobs.read({variable: value})
    assert getattr(got, field) == want
    assert dataclasses.replace(got, **{field: getattr(Knobs(), field)}) == Knobs()  # no other field moved


def test_every_field_is_a_variable_the_docstring_lists():
    doc = knobs.__doc__
    fields = [f for f in dataclasses.fields(Knobs) if f.name not in PASSED_IN]
    for field in fields:
        assert f"\n    {var(field)}=" in doc, var(field)
    listed = set(re.findall(r"^    (CLGPT_\w+)=", doc, re.M))
    assert listed == {var(f) for f in fields}
    for name in PASSED_IN:  # listed too, by field name
        assert f"\n    {name}=" in doc, name


def test_no_variable_sets_a_field_code_passes_in():
    """A field that changes results is no variable: CLGPT_ plus its name in capitals leaves the defaults."""
    assert PASSED_IN <= {f.name for f in dataclasses.fields(Knobs)}
    env = {var(f): "0" for f in dataclasses.fields(Knobs) if f.name in PASSED_IN}
    assert env and knobs.read(env) == Knobs()
    assert Knobs(wgmma_min_mnk=0).wgmma_min_mnk == 0  # passed in


@pytest.mark.parametrize("variable, value, message", [
    ("CLGPT_LAUNCH", "tpu", "CLGPT_LAUNCH='tpu': use cpu, nvidia or gpu"),
    ("CLGPT_REDUCE_THREADS", "two", "CLGPT_REDUCE_THREADS='two': set it to a number of threads"),
    ("CLGPT_MMA", "BM=wide", "CLGPT_MMA='BM=wide': 'BM' needs an integer"),
    ("CLGPT_MATMUL", "off", "CLGPT_MATMUL='off': 'off' needs an integer"),
    ("CLGPT_FLASH", "BM=64", "CLGPT_FLASH: unknown BM; set FWD_MT, KS"),
    ("CLGPT_SUBGROUP", "wide", "CLGPT_SUBGROUP='wide': set it to off or a sub-group size the device offers"),
])
def test_a_value_that_cannot_be_used_is_a_one_line_error_naming_the_variable(variable, value, message):
    with pytest.raises(ClgptError, match=re.escape(message)) as err:
        knobs.read({variable: value})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("variable, value, field, want", [
    ("CLGPT_PRESET", "2", "preset", None),  # only 0 and 1 override the table's
    ("CLGPT_MMA", "off", "mma", None),  # only the bf16 and wgmma GEMMs can be turned off
    ("CLGPT_BF16_SMALL", "off", "bf16_small", None),
    ("CLGPT_MMA_EMULATE", "0", "mma_emulate", False),
    ("CLGPT_NV_VERBOSE", "0", "nv_verbose", True),  # any non-empty value
    ("CLGPT_REDUCE", "", "reduce", ""),  # anything but shm sums through MPI (clgpt.training.dist)
    ("CLGPT_REDUCE_THREADS", "0", "reduce_threads", 1),
])
def test_lenient_values_read_as_they_always_have(variable, value, field, want):
    assert getattr(knobs.read({variable: value}), field) == want


def _modules():
    return [p for p in sorted((ROOT / "clgpt").rglob("*.py")) if p != ROOT / "clgpt" / "device" / "knobs.py"]


def test_no_module_but_knobs_reads_a_clgpt_variable():
    """Every knob is read through clgpt.device.knobs: no other module mentions os.environ beside a CLGPT_ name, or holds a
    CLGPT_ name as a string of its own (which a split line could pass to os.environ), but the RANK_DIR protocol."""
    assert len(_modules()) > 20
    for path in _modules():
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            assert not ("environ" in line and re.search(r"CLGPT_(?!RANK_DIR)", line)), f"{path}:{n}: {line}"
        tree = ast.parse(text)
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        names = {m for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and id(node) not in docs for m in re.findall(r"CLGPT_\w+", node.value)}
        assert names <= PROTOCOL, f"{path}: {sorted(names - PROTOCOL)}"


def test_the_flash_knob_names_the_tiles_attention_has():
    from clgpt.ops.attention import FLASH_TILES

    assert tuple(FLASH_TILES) == knobs.FLASH_KEYS
