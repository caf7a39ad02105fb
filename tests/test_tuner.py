"""The device tuners (clgpt/device/tuner.py; tuner_flash.py, portable flash attention's tiles): their candidates
against the limits of GPUs people own, each kernel form they build matching float64 on this device, a deterministic
pick, a wrong candidate rejected, the cache written and read, the `tuning` setting's off / pinned file, and an
engine run on a tuner record (per-product tiles and split-K) against the float64 reference, bit-identical twice."""

from __future__ import annotations

import json
import re

import pytest

from clgpt.device import tuner, tuner_flash, tuning
from clgpt.device.knobs import Knobs
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig

# Device profiles: (max work-group size, local memory bytes) of GPUs people own. AMD (RDNA / GCN: 256 work-items
# by default), Intel Arc (1024, 64 KB, no fp64), Arm Mali (384 or 256 work-items... and 32 KB of local memory),
# Apple (1024, 32 KB), Mesa's llvmpipe (32 KB, the strictest CPU runtime), a Qualcomm Adreno-like 256 / 32 KB.
PROFILES = {
    "amd": tuner.Limits(256, (256, 256), 65536),
    "intel-arc": tuner.Limits(1024, (1024, 1024), 65536),
    "mali": tuner.Limits(256, (256, 256), 32768),
    "apple": tuner.Limits(1024, (1024, 1024), 32768),
    "llvmpipe": tuner.Limits(1024, (1024, 1024), 32768),
    "adreno": tuner.Limits(256, (256, 256), 32768),
}
SUBGROUPS = (8, 16, 32, 64)
CFG = ModelConfig(vocab_size=37, n_ctx=80, n_embd=16, n_head=2, n_layer=1, n_ff=32)


def _threads(mm):
    return (mm["TSM"] // mm["WPTM"]) * (mm["TSN"] // mm["WPTN"])


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_candidates_fit_each_profile(name):
    """Every candidate a profile keeps fits its work-group and local-memory limits and fills whole subgroups of
    8 to 64; the generic row stays a candidate wherever it fits; what is dropped is dropped for a reason."""
    lim = PROFILES[name]
    kept = tuner.candidates(lim)
    assert len(kept) >= 8
    for mm in kept:
        assert _threads(mm) <= lim.max_group and tuner.local_bytes(mm) <= lim.local_mem, mm
        assert all(_threads(mm) % sg == 0 for sg in SUBGROUPS), mm
    generic = next(mm for mm in tuner.CANDIDATES if mm["TSM"] == tuning._GPU["TSM"] and mm["TSK"] == tuning._GPU["TSK"]
                   and mm["WPTM"] == tuning._GPU["WPTM"] and mm["LDSV"] == 0 and mm["PREF"] == 0)
    assert generic in kept
    for mm in tuner.CANDIDATES:
        if mm not in kept:
            assert tuner.fits(mm, lim), mm
    assert tuner.fits(dict(generic, TSM=256, WPTM=1), lim)  # 64 x 8 = 512 work-items: over 256, or fine at 1024
    assert tuner.fits(dict(generic, TSK=64, PREF=1), tuner.Limits(1024, (1024, 1024), 32768))  # 69632 bytes
    warp = [mm for mm in kept if mm.get("WARP")]
    assert warp, "no warp-tiled candidate fits"
    assert tuner.fits(tuner._warp_row(16, 16, 8, 4, 4), lim)  # 16 work-items: not a whole warp
    assert tuner.fits(tuner._warp_row(64, 48, 8, 4, 4), lim)  # 48 columns: not whole warp tiles of 32


def test_tuned_kernel_needs_no_fp64_half_or_subgroups():
    """Intel Arc has no fp64, NVIDIA's OpenCL no fp16 and no subgroups: the kernel the tuner builds (matmul.cl
    with its includes, as compiled) uses none of them, whatever the tiles."""
    from clgpt.device.opencl import KERNEL_DIR, kernel_source

    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", kernel_source(KERNEL_DIR / "matmul.cl"), flags=re.S)  # code only
    assert not re.search(r"\bdouble\b(?!-)|\bhalf\d*\b|cl_khr_fp(64|16)|sub_group|intel_sub", text)


def _profile_picks():
    """Under each profile, the candidate using the most local memory and the one with the most work-items: the
    kernels built nearest each limit (deduplicated across profiles, in order)."""
    out = []
    for lim in PROFILES.values():
        kept = tuner.candidates(lim)
        vec = [mm for mm in kept if mm.get("VEC")]
        for mm in (max(kept, key=tuner.local_bytes), max(kept, key=_threads), max(vec, key=tuner.local_bytes)):
            if mm not in out:
                out.append(mm)
    return out


@pytest.fixture(scope="module")
def bench(dev):
    return tuner._Bench(dev, [(64, 48, 96, 0, 0)])


@pytest.mark.parametrize("i", range(len(_profile_picks())))
def test_profile_kernels_match_float64(bench, i):
    """The kernels built nearest each profile's limits, in the layouts a step runs (y = x W.T, dx = dy W,
    dW = dy.T x split two ways), match float64 numpy at sizes no tile divides."""
    mm = _profile_picks()[i]
    for ta, tb, S in ((0, 1, 1), (0, 0, 1), (1, 0, 2)):
        assert bench.check(mm, ta, tb, S) == "", (mm, ta, tb, S)


@pytest.mark.parametrize("i", range(sum(1 for mm in tuner.CANDIDATES if mm.get("WARP"))))
def test_warp_candidates_match_float64(bench, i):
    """Each warp-tiled candidate of the tuner, in every layout and split-K, matches float64 numpy both at odd sizes
    (one-float loads) and at multiples of 4 with a whole 128 x 128 tile inside (float4 loads and stores)."""
    mm = [mm for mm in tuner.CANDIDATES if mm.get("WARP")][i]
    for ta, tb, S in ((0, 1, 1), (0, 0, 1), (1, 0, 1), (1, 1, 1), (1, 0, 2)):
        assert bench.check(mm, ta, tb, S) == "", (mm, ta, tb, S)


def test_tune_picks_deterministically_rejects_wrong_and_shows_progress(dev, capfd):
    """A candidate that computes wrong sums (CAUSAL=2 stops k early) is rejected before it is timed; equal times
    go to the earlier candidate and the unsplit product; the same timings give the same record; progress and the
    rounds go to stderr."""
    wrong = dict(tuning._GPU_SMALL, CAUSAL=2)
    small = tuner._row(32, 32, 16, 4, 4, 0, 0)
    big = tuner._row(64, 64, 16, 8, 8, 1, 1)
    products = [((64, 48, 32, 0, 1), 1), ((48, 32, 2048, 1, 0), 1)]
    timed = []

    def equal(mm, prod, S):
        timed.append((mm is wrong, S))
        return 1.0

    rec = tuner.tune(dev, products, cands=[wrong, small, big], measure=equal)
    assert "disagrees with float64" in rec["rejected"]["0"] and not any(w for w, _ in timed)
    assert rec["matmul"] == 1 and rec["matmul_small"] == 1
    assert [(s["tiles"], s["split"]) for s in rec["products"]] == [(1, 1), (1, 1)]
    assert any(S > 1 for _, S in timed), "split-K was never tried on the weight gradient"
    assert "tuning GEMM (candidates)" in capfd.readouterr().err

    def favour(mm, prod, S):  # the big tiles faster everywhere, split 4 fastest on the deep product
        return (0.5 if mm is big else 1.0) / (2 if S == 4 else 1)

    runs = [tuner.tune(dev, products, cands=[wrong, small, big], measure=favour, progress=False) for _ in range(2)]
    for r in runs:
        r.pop("seconds")
    assert runs[0] == runs[1]
    assert runs[0]["matmul"] == 2 and [(s["tiles"], s["split"]) for s in runs[0]["products"]] == [(2, 1), (2, 4)]


def _record(dev, split=2):
    """A record for CFG at batch 4 x 80 without timing, as a file would hold it: the weight gradients on 32 x 32
    tiles (float4 loads) split `split` ways, dx = dy @ W on 64 x 32 tiles (float4 loads), the forward products and
    the big tiles (attention's batched products) on the warp-tiled form."""
    cands = [tuner._row(32, 32, 16, 4, 4, 0, 0, 1), tuner._row(64, 32, 16, 4, 4, 1, 1, 1),
             tuner._warp_row(32, 32, 8, 4, 4)]
    products = tuner.model_products(CFG, 4, 80)
    shapes = [dict(product=list(p), tiles=0 if p[3] else 2 if p[4] else 1, split=split if p[3] else 1, ms=1.0)
              for p, _ in products]
    return dict(schema=tuner.SCHEMA, candidates=cands, matmul=2, matmul_small=0, products=shapes, rejected={},
                stopped_at=None, seconds=0.0, step_ms={})


def test_cache_written_then_read(dev, tmp_path, monkeypatch):
    """auto's first run tunes and writes the device's cache file; the second reads it (no tuning); another
    model's record goes into the same file beside it; the file name carries the device."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_tune(d, products, progress=True):
        calls.append(products)
        return _record(d)

    monkeypatch.setattr(tuner, "tune", fake_tune)
    rec, path, fresh = tuner.tuned_for(dev, CFG, 4, 80, say=lambda m: None)
    assert fresh and path.exists() and path.parent == tmp_path / "clgpt" / "tuning" and len(calls) == 1
    again, path2, fresh2 = tuner.tuned_for(dev, CFG, 4, 80, say=lambda m: None)
    assert not fresh2 and path2 == path and again == rec and len(calls) == 1
    tuner.tuned_for(dev, CFG, 2, 80, say=lambda m: None)
    assert len(calls) == 2 and len(json.loads(path.read_text())["records"]) == 2
    assert tuner.device_id(dev.device)["name"].split()[0].strip("-")[:4] in path.name or "device" in path.name


def test_tuning_setting_off_pinned_and_errors(dev, tmp_path, monkeypatch):
    """off: no record; a pinned file: its record for this model as written; a missing file, one without this
    model's record, a broken record, a CPU row: one-line errors naming the file or the row; auto on a CPU
    device: no record."""
    gpu_row = tuning.launch_config(dev.device, Knobs(launch="gpu"))
    cpu_row = tuning.launch_config(dev.device, Knobs(launch="cpu"))
    assert tuner.resolve("off", dev, CFG, 4, 80, gpu_row)[0] is None
    path = tmp_path / "pinned.json"
    rec = _record(dev)
    tuner.save(path, dev.device, tuner.model_key(tuner.model_products(CFG, 4, 80)), rec)
    got, line = tuner.resolve(str(path), dev, CFG, 4, 80, gpu_row)
    assert got == rec and str(path) in line
    with pytest.raises(ClgptError, match="no record for this model"):
        tuner.resolve(str(path), dev, CFG, 2, 80, gpu_row)
    with pytest.raises(ClgptError, match="missing.json"):
        tuner.resolve(str(tmp_path / "missing.json"), dev, CFG, 4, 80, gpu_row)
    with pytest.raises(ClgptError, match="CPU GEMM"):
        tuner.resolve(str(path), dev, CFG, 4, 80, cpu_row)
    bad = json.loads(path.read_text())
    next(iter(bad["records"].values()))["matmul"] = 7
    path.write_text(json.dumps(bad))
    with pytest.raises(ClgptError, match="not a clgpt GEMM tuning record"):
        tuner.resolve(str(path), dev, CFG, 4, 80, gpu_row)
    if not dev.device.type & tuner.cl.device_type.GPU:
        assert tuner.resolve("auto", dev, CFG, 4, 80, gpu_row)[0] is None


def test_engine_on_a_tuned_record_matches_reference_twice(dev):
    """The GPU row with a tuner record (per-product tiles with float4 loads, the weight gradients split along K,
    attention's batched products on its big tiles): grads against the float64 reference, two runs bit-identical,
    and the record's tiles are what the products were built with."""
    from enginecheck import assert_two_runs_match_reference, batch, noisy_params

    from clgpt.models import reference as ref
    from clgpt.models.gpt2 import GPT2Engine as Engine

    p = noisy_params(CFG, seed=3, std=0.1)
    tokens, targets, mask = batch(CFG, 4, 80, seed=5)
    want_loss, cache = ref.gpt_forward(p, CFG, tokens, targets, mask)
    want_g = ref.gpt_backward(cache)
    rec = _record(dev)
    runs = []
    for _ in range(2):
        eng = Engine(CFG, p, batch_size=4, seq_len=80, knobs=Knobs(launch="gpu", gemm_tuning=rec))
        eng.ops.attn_gemm = True  # attention as batched products on the record's big tiles (T = 80 is short)
        shapes = eng.ops.launch["matmul_shapes"]
        assert len(shapes) == len(rec["products"])
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        runs.append((loss, eng.get_grads()))
        built = {key[-2] for key in eng.ops.product_kernels}
        assert {id(mm) for mm, _ in shapes.values()} <= built
        assert any(key[6] for key in eng.ops.product_kernels), "no product was split along K"
    assert_two_runs_match_reference(runs, want_loss, want_g)


def test_stage_setting_checked_and_default_kept_out_of_checkpoints():
    """`tuning` is a stage setting: auto (the default) leaves the settings, so checkpoints and resume keys, as
    they were before it existed; off and a path are kept; an empty value is a one-line error naming the key."""
    from clgpt.training.train import stage_settings

    assert "tuning" not in stage_settings("pretrain", {})
    assert "tuning" not in stage_settings("pretrain", {"tuning": "auto"})
    assert stage_settings("tune", {"tuning": "off"})["tuning"] == "off"
    assert stage_settings("pretrain", {"tuning": "t.json"})["tuning"] == "t.json"
    with pytest.raises(ClgptError, match="tuning"):
        stage_settings("pretrain", {"tuning": ""})


def test_tune_device_command_writes_a_file_a_stage_can_pin(dev, tmp_path, monkeypatch, capsys):
    """`clgpt tune-device` (one candidate, a one-layer model) measures, prints its total time, writes the cache
    and --out; the --out file then resolves as a pinned tuning file for the same model and batch."""
    from clgpt.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "tuned.json"
    shape = ["--vocab", "37", "--ctx", "80", "--embd", "16", "--heads", "2", "--layers", "1", "--ffn", "32"]
    assert main(["tune-device", *shape, "--batch", "4", "--max-candidates", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"tuned in [\d.]+ s \(GEMM [\d.]+, .*\n.*tuned: big tiles", text) and str(out) in text
    assert len(list((tmp_path / "cache" / "clgpt" / "tuning").glob("*.json"))) == 1
    rec, line = tuner.resolve(str(out), dev, CFG, 4, 80, tuning.launch_config(dev.device, Knobs(launch="gpu")))
    assert rec["matmul"] == 0 and len(rec["products"]) == len(tuner.model_products(CFG, 4, 80))


# ---- portable flash attention's tiles (clgpt/device/tuner_flash.py) ----
@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("D", [64, 128])
def test_flash_candidates_fit_each_profile(name, D):
    """Under each profile, at head widths 64 and 128, every kernel keeps candidates within its work-group and
    local-memory limits, filling whole subgroups of 8 to 64 (head width 64: at least three to choose from)."""
    lim = PROFILES[name]
    for kernel in tuner_flash.DEFAULT:
        kept = tuner_flash.candidates(kernel, D, lim.max_group, lim.local_mem)
        assert len(kept) >= (3 if D == 64 else 1), (kernel, kept)
        for t in kept:
            assert t[0] * t[2] <= lim.max_group and tuner_flash.local_bytes(kernel, D, t) <= lim.local_mem
            assert all(t[0] * t[2] % sg == 0 for sg in SUBGROUPS), t


def test_flash_tune_rejects_wrong_tiles_and_picks_the_fastest_deterministically(dev):
    """A candidate that does not build (NC 3 divides neither D nor BC) is rejected before it is timed; the fastest
    of the rest wins, equal times going to the earlier; progress names each kernel's choice."""
    cands = {k: [(32, 16, 3), (32, 16, 4), (64, 16, 2)] for k in tuner_flash.DEFAULT}
    timed, said = [], []

    def measure(kernel, tiles):
        timed.append(tiles)
        return 1.0 if kernel == "forward" or tiles == (32, 16, 4) else 0.5

    rec = tuner_flash.tune(dev, 2, 2, 40, 8, progress=said.append, cands=cands, measure=measure)
    assert (32, 16, 3) not in timed and "build" in rec["rejected"]["forward (32, 16, 3)"]
    assert rec["tiles"] == dict(forward=[32, 16, 4], dq=[64, 16, 2], dkv=[64, 16, 2])
    assert len(said) == 3 and said[0].startswith("flash attention forward: tiles (32, 16, 4)")


def test_flash_record_weighs_the_batched_form_and_auto_follows_it(dev):
    """Given the batched form's time, the record's form is the faster of the two (flash on a tie), else flash; Ops on
    the generic row at T >= MIN_T takes portable flash attention with no record or a flash one, the batched form
    with a batched one; attention_seconds times both forms; scores that would fill over a quarter of the device's
    memory are kept from the weighing."""
    from types import SimpleNamespace

    import pyopencl as cl

    from clgpt.ops import Ops, attention_seconds

    cands = {k: [(32, 16, 4)] for k in tuner_flash.DEFAULT}
    for batched_s, form in ((2.0, "batched"), (3.0, "flash"), (4.0, "flash")):  # flash: 3 kernels of 1 s
        rec = tuner_flash.tune(dev, 2, 2, 40, 8, progress=lambda m: None, cands=cands,
                               measure=lambda kernel, tiles: 1.0, batched=lambda: batched_s)
        assert (rec["form"], rec["flash_ms"], rec["batched_ms"]) == (form, 3000.0, batched_s * 1e3), rec
        assert 0 <= rec["batched_seconds"] <= rec["seconds"], rec
    rec = tuner_flash.tune(dev, 2, 2, 40, 8, progress=lambda m: None, cands=cands, measure=lambda k, t: 1.0)
    assert rec["form"] == "flash" and "batched_ms" not in rec
    T = tuner_flash.MIN_T
    cfg = ModelConfig(vocab_size=37, n_ctx=T, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    tiles = tuner_flash.check_record(rec, "test")
    for tuned, flash in ((None, True), (tiles, True), ({**tiles, "form": "batched"}, False)):
        ops = Ops(dev, cfg, T, "fp32", batch_size=1, knobs=Knobs(launch="gpu", flash_tuning=tuned))
        assert ops.flash_portable is flash, tuned
    small = ModelConfig(vocab_size=37, n_ctx=48, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    assert all(attention_seconds(dev, small, 2, 48, Knobs(launch="gpu"), form) > 0 for form in ("batched", "flash"))
    gpu, row = SimpleNamespace(type=cl.device_type.GPU), tuning.launch_config(dev.device, Knobs(launch="gpu"))
    assert tuner_flash.wanted(gpu, row, T, Knobs(launch="gpu")) and not tuner_flash.wanted(gpu, row, T - 1, Knobs(launch="gpu"))
    assert not tuner_flash.wanted(gpu, row, T, Knobs(launch="gpu", mma_emulate=True))  # tensor cores: not its row
    L = ModelConfig(vocab_size=8192, n_ctx=512, n_embd=768, n_head=12, n_layer=12, n_ff=3072)  # 2.4 GB of scores
    assert tuner_flash.scores_too_big(SimpleNamespace(global_mem_size=8 << 30), L, 16, 512)
    assert not tuner_flash.scores_too_big(SimpleNamespace(global_mem_size=80 << 30), L, 16, 512)
    with pytest.raises(ClgptError, match="form 'fast' is neither flash nor batched"):
        tuner_flash.check_record({**rec, "form": "fast"}, "file.json")


def test_flash_tiles_setting_auto_off_pinned_and_cached(dev, tmp_path, monkeypatch):
    """off: the defaults; auto where the run would not take portable flash attention (a CPU device, T below
    MIN_T): not tuned; auto where it would: tuned once into the GEMM's cache file, then read; a pinned file: its
    record (none for this shape: the defaults); a broken record: a one-line error naming the file."""
    GPU = Knobs(launch="gpu")
    gpu_row = tuning.launch_config(dev.device, GPU)
    T = tuner_flash.MIN_T
    assert tuner_flash.resolve("off", dev, CFG, 4, T, gpu_row, GPU)[0] is None
    tiles, line = tuner_flash.resolve("auto", dev, CFG, 4, T - 1, gpu_row, GPU)
    assert tiles is None and "the defaults" in line
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tuner_flash, "wanted", lambda device, row, t, kn: t >= T)
    calls = []
    monkeypatch.setattr(tuner_flash, "tune", lambda d, B, H, t, D, progress=print, batched=None: calls.append(t)
                        or dict(tiles=dict(forward=[32, 16, 4], dq=[64, 16, 4], dkv=[32, 32, 4]), form="batched",
                                seconds=0.5))
    first, line = tuner_flash.resolve("auto", dev, CFG, 4, T, gpu_row, GPU, say=lambda m: None)
    again, line2 = tuner_flash.resolve("auto", dev, CFG, 4, T, gpu_row, GPU)
    assert first == again == dict(forward=(32, 16, 4), dq=(64, 16, 4), dkv=(32, 32, 4), form="batched")
    assert calls == [T] and line2.endswith("dkv 32x32x4; batched)")
    assert "tuned now" in line and "cached" in line2
    path = tuner.cache_file(dev.device)
    assert tuner_flash.resolve(str(path), dev, CFG, 4, T, gpu_row, GPU)[0] == first
    assert tuner_flash.resolve(str(path), dev, CFG, 2, T, gpu_row, GPU)[0] is None
    bad = json.loads(path.read_text())
    next(iter(bad["records"].values()))["tiles"].pop("dq")
    path.write_text(json.dumps(bad))
    with pytest.raises(ClgptError, match="names no tiles for forward, dq, dkv"):
        tuner_flash.resolve(str(path), dev, CFG, 4, T, gpu_row, GPU)


def test_bf16_storage_pair_decides_precision_auto(dev):
    """The tuner times each product of the step on its chosen tiles in fp32 and on bf16 storage (the copies' making
    included), after checking the bf16-storage forms against float64 of rounded operands; `precision: auto` on the
    generic GPU row takes bf16 only where that pair's bf16 sum is the smaller, and a CPU row (no record) keeps fp32."""
    from clgpt.device import precision
    from clgpt.models.gpt2 import GPT2Engine as Engine

    products = [((64, 48, 32, 0, 1), 3), ((48, 32, 2048, 1, 0), 1)]
    cands = [tuner._row(32, 32, 16, 4, 4, 0, 0), tuner._row(64, 64, 16, 8, 8, 1, 1)]
    seen = []

    def faster16(mm, prod, S):
        seen.append((bool(mm.get("A16")), prod))
        return 0.5e-3 if mm.get("A16") else 1e-3

    rec = tuner.tune(dev, products, cands=cands, measure=faster16, progress=False)
    pair = rec["bf16_storage"]
    assert pair == dict(fp32_ms=4.0, bf16_ms=2.0), pair  # 3 + 1 runs a step, 1 and 0.5 ms each
    assert {(s, p) for s in (False, True) for p, _ in products} <= set(seen)
    kn = Knobs(launch="gpu", gemm_tuning=rec)
    assert precision.resolve("auto", dev.device, kn) == "bf16" and "bf16 storage" in precision.auto_reason(dev.device, kn)
    slower = tuner.tune(dev, products, cands=cands, measure=lambda mm, p, S: 2e-3 if mm.get("A16") else 1e-3,
                        progress=False)
    assert precision.resolve("auto", dev.device, Knobs(launch="gpu", gemm_tuning=slower)) == "fp32"
    assert precision.resolve("auto", dev.device, Knobs(launch="cpu")) == "fp32"
    assert "ms on bf16 storage" in tuner.describe(rec)
    cfg_rec = dict(_record(dev), bf16_storage=dict(fp32_ms=2.0, bf16_ms=1.0))
    eng = Engine(CFG, tuner_params(), batch_size=4, seq_len=80, precision="auto",
                 knobs=Knobs(launch="gpu", gemm_tuning=cfg_rec))
    assert eng.precision == "bf16" and eng.ops.facts.bf16_storage


def tuner_params():
    from clgpt.model import init_params

    return init_params(CFG, 0)


def test_builds_beside_run_each_job_once_and_only_where_tuning_comes(dev, tmp_path, monkeypatch):
    """The flash and row tuners' candidate builds go beside the GEMM's tuning only where `tuning: auto` is about to
    tune them (wanted, not cached); each job runs once by join(), which surfaces an unexpected error; a host of
    fewer than four cores builds nothing beside (its tuners build later)."""
    import os
    import threading

    from clgpt.device import builds, tuner_rows
    from clgpt.training import tuned

    ran, lock = [], threading.Lock()

    def job(i):
        with lock:
            ran.append(i)

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    beside = builds.BuildsBeside([lambda i=i: job(i) for i in range(20)])
    beside.join()
    beside.join()
    assert sorted(ran) == list(range(20))
    failing = builds.BuildsBeside([lambda: 1 / 0])
    with pytest.raises(ZeroDivisionError):
        failing.join()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    ran.clear()
    builds.BuildsBeside([lambda: job(0)]).join()
    assert ran == []

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    GPU = Knobs(launch="gpu")
    row, T = tuning.launch_config(dev.device, GPU), tuner_flash.MIN_T
    monkeypatch.setattr(tuner_flash, "wanted", lambda device, r, t, kn: t >= T)
    monkeypatch.setattr(tuner_rows, "wanted", lambda device, r, kn: True)
    flash, rows = len(tuner_flash.build_jobs(dev, CFG.n_head, CFG.head_dim)), len(tuner_rows.build_jobs(dev, CFG))
    assert flash >= 3 and rows >= 2
    jobs = tuned._untuned_builds("auto", dev, CFG, 4, T, row, GPU)
    assert len(jobs) == flash + rows + 1  # and the batched form's programs, which the flash tuner times against
    jobs[flash]()  # the batched form's programs (after flash's candidates): built, leaving its Ops nothing to build
    assert tuned._untuned_builds("off", dev, CFG, 4, T, row, GPU) == []
    assert len(tuned._untuned_builds("auto", dev, CFG, 4, T - 1, row, GPU)) == rows  # no flash below MIN_T
    path = tuner.cache_file(dev.device)
    for key in (tuner_flash.record_key(4, CFG.n_head, T, CFG.head_dim), tuner_rows.record_key(CFG, 4, T)):
        tuner.save(path, dev.device, key, dict(seconds=0.0))
    assert tuned._untuned_builds("auto", dev, CFG, 4, T, row, GPU) == []
