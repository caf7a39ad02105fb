"""The row kernels' tuner (clgpt/device/tuner_rows.py) on every CPU implementation: its candidates (work-group
sizes by reduction: local memory, or each sub-group size the device offers), the float64 check that rejects a
candidate that cannot build, the choice (the fastest, ties to the table's first), the record read back from a
tuning file, and the forms it sets: the launch row's work-group sizes and the capabilities' sub-group fields, with
an engine built on them matching the float64 reference."""

from __future__ import annotations

from types import SimpleNamespace

import pyopencl as cl
import pytest

from clgpt.device import tuner, tuner_rows
from clgpt.device.capabilities import capabilities, subgroup_sizes
from clgpt.device.knobs import Knobs
from clgpt.device.opencl import cpu_implementations, get_device
from clgpt.device.tuning import launch_config
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig
from clgpt.models import reference as ref
from clgpt.models.gpt2 import GPT2Engine

from enginecheck import batch, max_rel, noisy_params

IMPLS = cpu_implementations()
CFG = ModelConfig(vocab_size=61, n_ctx=16, n_embd=128, n_head=4, n_layer=1, n_ff=64)
GPU = Knobs(launch="gpu")
B, T = 2, 16


def _few(dev) -> dict:
    """The candidates of one work-group size a family (every reduction): the builds of a quick test."""
    c = tuner_rows.candidates(dev, CFG.n_embd)
    return dict(norm=[x for x in c["norm"] if x["ln_rw"] == 2], rows=[x for x in c["rows"] if x["rows"] == 64])


@pytest.mark.parametrize("impl", IMPLS)
def test_candidates_are_every_reduction_the_device_offers(impl):
    dev = get_device(IMPLS[impl])
    sizes, fixed = subgroup_sizes(dev.device)
    c = tuner_rows.candidates(dev, CFG.n_embd)
    assert c["norm"][0] == dict(ln_rw=4, sg="local") and c["rows"][0] == dict(rows=128, sg="local")
    assert {x["sg"] for x in c["norm"]} == {"local", *(n for n in sizes if fixed and 32 % n == 0)}
    assert {x["sg"] for x in c["rows"] if x["rows"] == 128} == {"local", *(n for n in sizes if fixed),
                                                                 *(["auto"] if sizes and not fixed else [])}
    assert tuner_rows.candidates(dev, 96)["norm"] == []  # C % 128 != 0: no row slices to time


@pytest.mark.parametrize("impl", IMPLS)
def test_tune_keeps_the_fastest_that_matches_float64_ties_to_the_first(impl):
    """With a measure that makes the last candidate of each family fastest it is chosen; with equal times the
    first; a candidate that cannot build (sub-groups of 7) is rejected with its reason and never chosen."""
    dev = get_device(IMPLS[impl])
    cands = _few(dev)
    last = {f: cands[f][-1] for f in cands}
    rec = tuner_rows.tune(dev, CFG, B, T, progress=lambda line: None, cands=cands,
                          measure=lambda f, c: 1.0 if c == last[f] else 2.0)
    assert rec["norm"] == last["norm"] and rec["rows"] == last["rows"], rec
    assert not rec["rejected"] and len(rec["ms"]) == len(cands["norm"]) + len(cands["rows"])
    broken = dict(norm=[dict(ln_rw=2, sg=7)] + cands["norm"], rows=[dict(rows=64, sg=7)] + cands["rows"])
    rec = tuner_rows.tune(dev, CFG, B, T, progress=lambda line: None, cands=broken, measure=lambda f, c: 1.0)
    assert rec["norm"] == cands["norm"][0] and rec["rows"] == cands["rows"][0], rec
    assert sorted(rec["rejected"]) == ["norm 2 rows a work-group, sub-groups of 7",
                                       "rows 64 work-items a row, sub-groups of 7"], rec["rejected"]
    rec = tuner_rows.tune(dev, CFG, B, T, progress=lambda line: None, cands=cands, budget_s=0.0,
                          measure=lambda f, c: 1.0 if c == last[f] else 2.0)  # out of time after the first
    assert rec["norm"] == cands["norm"][0] and rec["rows"] == cands["rows"][0] and len(rec["ms"]) == 2, rec


@pytest.mark.parametrize("impl", IMPLS)
def test_a_record_sets_the_row_forms_and_the_engine_matches_float64(impl, tmp_path):
    """A record (here the last candidate of each family: a sub-group size where the device offers one) read back
    from a pinned tuning file sets the GPU row's work-group sizes and sub-group fields; a gpt2 engine on them
    matches the float64 reference. The CPU row ignores it; CLGPT_SUBGROUP, where set, wins."""
    dev = get_device(IMPLS[impl])
    cands = _few(dev)
    want = {f: cands[f][-1] for f in cands}
    rec = dict(want, ms={}, rejected={}, seconds=0.0)
    path = tmp_path / "tuning.json"
    tuner.save(path, dev.device, tuner_rows.record_key(CFG, B, T), rec)
    row = launch_config(dev.device, Knobs(launch="gpu"))
    got, line = tuner_rows.resolve(str(path), dev, CFG, B, T, row, GPU)
    assert got == rec and line.startswith(f"row kernels: pinned file {path}")
    assert tuner_rows.resolve("off", dev, CFG, B, T, row, GPU)[0] is None
    gpu = SimpleNamespace(type=cl.device_type.GPU)
    assert tuner_rows.wanted(gpu, row, GPU) and not tuner_rows.wanted(gpu, row, Knobs(launch="gpu", mma_emulate=True))
    assert tuner_rows.resolve("auto", dev, CFG, B, T, row, GPU)[1] == \
        "row kernels: the table's forms (tuned only on a GPU's generic row)"
    kn = Knobs(launch="gpu", rows_tuning=got)
    caps = capabilities(dev.device, kn)
    sg = want["rows"]["sg"]
    assert (caps.group_rows, caps.launch["ln_rw"]) == (64, 2)
    assert (caps.subgroup_reduce, caps.subgroup) == ((sg != "local"), (0 if sg in ("local", "auto") else sg))
    assert caps.row_subgroup == (0 if want["norm"]["sg"] == "local" else want["norm"]["sg"])
    assert capabilities(dev.device, Knobs(launch="cpu", rows_tuning=got)).group_rows == 0
    assert not capabilities(dev.device, Knobs(launch="gpu", rows_tuning=got, subgroup=0)).subgroup_reduce
    p = noisy_params(CFG)
    tokens, targets, mask = batch(CFG, B, T)
    eng = GPT2Engine(CFG, p, batch_size=B, seq_len=T, device=dev, knobs=kn)
    eng.ops.facts.attn_gemm = True  # the softmax row kernels at this short T too
    loss = eng.forward(tokens, targets, mask)
    eng.zero_grad()
    eng.backward()
    loss_ref, cache = ref.gpt_forward(p, CFG, tokens, targets, mask)
    assert abs(loss - loss_ref) < 1e-5 * abs(loss_ref), f"loss {loss} vs reference {loss_ref}"
    worst, where = max_rel(eng.get_grads(), ref.gpt_backward(cache))
    assert worst < 1e-4, f"grads: max relative diff {worst:.3e} in {where}"


def test_a_record_without_forms_is_a_one_line_error(tmp_path):
    dev = get_device(next(iter(IMPLS.values())))
    path = tmp_path / "tuning.json"
    tuner.save(path, dev.device, tuner_rows.record_key(CFG, B, T), dict(rows=dict(rows="many"), norm=None))
    with pytest.raises(ClgptError, match=r"tuning file .*tuning.json: a row kernels' record names no forms"):
        tuner_rows.resolve(str(path), dev, CFG, B, T, launch_config(dev.device, GPU), GPU)


def test_auto_tunes_once_where_wanted_then_reads_the_cache(tmp_path, monkeypatch):
    """auto on a row the tuner serves (a GPU row; here forced): tuned once into the GEMM's cache file, then read
    back; the ranks of a data-parallel stage (may_tune False) read the cache only."""
    dev = get_device(next(iter(IMPLS.values())))
    row = launch_config(dev.device, Knobs(launch="gpu"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tuner_rows, "wanted", lambda device, launch_row, kn: True)
    assert tuner_rows.resolve("auto", dev, CFG, B, T, row, GPU, may_tune=False)[0] is None
    calls = []
    rec = dict(norm=dict(ln_rw=8, sg="local"), rows=dict(rows=256, sg="local"), ms={}, rejected={}, seconds=0.5)
    monkeypatch.setattr(tuner_rows, "tune", lambda d, cfg, b, t, progress=print: calls.append((b, t)) or rec)
    first, line = tuner_rows.resolve("auto", dev, CFG, B, T, row, GPU, say=lambda m: None)
    again, line2 = tuner_rows.resolve("auto", dev, CFG, B, T, row, GPU, may_tune=False)
    assert first == again == rec and calls == [(B, T)]
    assert "tuned now" in line and "cached" in line2 and "norm 8 rows a work-group, local" in line2
