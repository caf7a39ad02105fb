"""The contract every engine keeps, written once and checked for each architecture against its float64
reference model (gpt2: clgpt.models.reference; llama, dense, grouped-query and with a mixture of experts:
clgpt.models.reference_llama): the reference's gradients against finite differences; the engine's loss,
logits and gradients against the reference; the engine's gradients against finite differences of its own
loss; gradient accumulation over partial batches; twenty AdamW steps following the reference's; two
identical runs, and a run resumed from saved parameters and optimizer state, bit for bit alike; and label
smoothing: the smoothed loss and gradients where asked, the plain ones (and the plain programs) elsewhere.

Routing is discrete, so every gradient check of a mixture-of-experts model holds the routing fixed (reference:
`routing=`; engine: `freeze_routing`). Tolerances: loss 1e-5 relative; logits 1e-5 absolute; engine gradients
1e-4 relative to each tensor's largest gradient; the reference against float64 finite differences (eps 1e-6)
1e-7 + 1e-5 of the largest difference; the engine against float32 finite differences (eps 1e-2) 2e-3 + 2e-2
of it; after twenty steps, loss 1e-4 and the gradient norm 1e-3 relative at each step, parameters 1e-3."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyopencl as cl
import pytest

from clgpt.device.knobs import Knobs
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference as ref
from clgpt.models import reference_llama as ref_llama
from clgpt.models.gpt2 import GPT2Engine
from clgpt.models.llama import LlamaEngine

from enginecheck import batch, max_rel, noisy_params


def _gpt2(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=23, n_ctx=5, n_embd=8, n_head=2, n_layer=2, n_ff=12, tied=tied)


def _llama(E=0, K=0, hkv=0, tied=True, **kw) -> ModelConfig:
    d = dict(arch="llama", vocab_size=23, n_ctx=6, n_embd=8, n_head=2, n_head_kv=hkv, n_layer=2, n_ff=12,
             tied=tied, n_expert=E, n_expert_used=K, moe_aux_loss=0.05)
    d.update(kw)
    return ModelConfig(**d)


CASES = {  # gpt2 tied and untied; llama dense and grouped-query; MoE + GQA (untied), with k = 1, with k = E
    "gpt2_tied": _gpt2(True),
    "gpt2_untied": _gpt2(False),
    "llama": _llama(),
    "llama_gqa": _llama(n_head=4, hkv=2, tied=False),
    "moe": _llama(E=4, K=2, hkv=1, tied=False),
    "moe_k1": _llama(E=3, K=1),
    "moe_all": _llama(E=2, K=2),
}
# The noise on the parameters each architecture's checks were set with (the norms' weights and biases matter).
NOISE = {"gpt2": 0.1, "llama": 0.2}
# One case of each architecture for the checks that cost an engine run a probed entry or twenty steps.
ONE_EACH = ["gpt2_untied", "llama_gqa", "moe"]


def engine(cfg, p, batch_size, seq_len, knobs=Knobs(), **kw):
    return (GPT2Engine if cfg.arch == "gpt2" else LlamaEngine)(cfg, p, batch_size=batch_size, seq_len=seq_len,
                                                                knobs=knobs, **kw)


def reference(p, cfg, tokens, targets, mask, dropout=None, label_smoothing=0.0):
    """(loss, load-balancing loss, cache) of the float64 reference (gpt2: no load-balancing loss, 0); dropout:
    the engine's (seed, p) or None; label_smoothing: the engine's eps."""
    if cfg.arch == "gpt2":
        loss, cache = ref.gpt_forward(p, cfg, tokens, targets, mask, dropout=dropout, label_smoothing=label_smoothing)
        return loss, 0.0, cache
    return ref_llama.llama_forward(p, cfg, tokens, targets, mask, dropout=dropout, label_smoothing=label_smoothing)


def reference_grads(cfg, cache) -> dict:
    return ref.gpt_backward(cache) if cfg.arch == "gpt2" else ref_llama.llama_backward(cache)


def reference_logits(p, cfg, tokens):
    return ref.gpt_logits(p, cfg, tokens) if cfg.arch == "gpt2" else ref_llama.llama_logits(p, cfg, tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_grads_vs_finite_differences(case):
    cfg = CASES[case]
    p = {k: v.astype(np.float64) for k, v in noisy_params(cfg, std=NOISE[cfg.arch]).items()}
    tokens, targets, mask = batch(cfg, 2, 5)
    _, _, cache = reference(p, cfg, tokens, targets, mask)
    grads = reference_grads(cfg, cache)
    if cfg.arch == "gpt2":
        f = lambda q: ref.gpt_forward(q, cfg, tokens, targets, mask)[0]  # noqa: E731
    else:
        routing = ref_llama.routing_of(cache) if cfg.n_expert else None
        f = lambda q: ref_llama.llama_objective(q, cfg, tokens, targets, mask, routing)  # noqa: E731
    rng = np.random.default_rng(0)
    for name in p:
        idxs = rng.choice(p[name].size, size=min(6, p[name].size), replace=False)
        fd = ref.fd_entries(f, p, name, idxs, 1e-6)
        diff = np.abs(grads[name].flat[idxs] - fd).max()
        assert diff < 1e-7 + 1e-5 * np.abs(fd).max(), f"{case} {name}: max abs diff {diff:.3e}"


@pytest.mark.parametrize("case,launch_row", [(k, "") for k in CASES] + [("moe", "gpu"), ("moe_k1", "nvidia")])
def test_engine_loss_logits_and_grads_vs_reference(case, launch_row):
    """On this device's table row, and MoE on the GPU rows too (tiled grouped products, one-work-group routing);
    logits of the whole batch, and of generation-style and partial calls (B' = 1 and a growing T')."""
    cfg = CASES[case]
    p = noisy_params(cfg, std=NOISE[cfg.arch])
    B, T = 3, cfg.n_ctx
    eng = engine(cfg, p, B, T, knobs=Knobs(launch=launch_row))
    tokens, targets, mask = batch(cfg, B, T)
    loss = eng.forward(tokens, targets, mask)
    eng.zero_grad()
    eng.backward()
    loss_ref, aux_ref, cache = reference(p, cfg, tokens, targets, mask)
    assert abs(loss - loss_ref) < 1e-5 * abs(loss_ref), f"loss {loss} vs reference {loss_ref}"
    if cfg.arch == "llama":
        assert abs(eng.aux_loss() - aux_ref) < 1e-5 * max(1.0, aux_ref)
    if cfg.n_expert:
        np.testing.assert_allclose(eng.expert_usage(), ref_llama.expert_usage(cache), rtol=0, atol=1e-12)
        assert np.allclose(eng.expert_usage().sum(axis=1), cfg.n_expert_used)
    worst, where = max_rel(eng.get_grads(), reference_grads(cfg, cache))
    assert worst < 1e-4, f"grads: max relative diff {worst:.3e} in {where}"
    for Bp, Tp in ((B, T), (1, 1), (1, 2), (1, 4), (2, 3)):
        got = eng.forward(tokens[:Bp, :Tp])
        want = reference_logits(p, cfg, tokens[:Bp, :Tp])
        assert got.shape == want.shape == (Bp, Tp, cfg.vocab_size) and got.dtype == np.float32
        assert np.abs(got - want).max() < 1e-5, f"({Bp},{Tp}): logits max abs diff {np.abs(got - want).max():.3e}"


@pytest.mark.parametrize("case", ONE_EACH)
def test_engine_grads_vs_finite_differences(case):
    cfg = CASES[case]
    p = noisy_params(cfg, std=0.3)
    eng = engine(cfg, p, 2, 5)
    tokens, targets, mask = batch(cfg, 2, 5, seed=3)
    eng.forward(tokens, targets, mask)
    eng.zero_grad()
    eng.backward()
    grads = eng.get_grads()
    if cfg.arch == "llama":
        eng.freeze_routing(True)  # the finite differences must not flip an expert choice

    def f(q):
        eng.set_params(q)
        loss = eng.forward(tokens, targets, mask)
        return loss + cfg.moe_aux_loss * eng.aux_loss() if cfg.arch == "llama" else loss

    rng = np.random.default_rng(1)
    for name in p:
        idxs = rng.choice(p[name].size, size=min(3, p[name].size), replace=False)
        fd = ref.fd_entries(f, p, name, idxs, 1e-2)
        diff = np.abs(grads[name].flat[idxs] - fd).max()
        assert diff < 2e-3 + 2e-2 * np.abs(fd).max(), f"{name}: max abs diff {diff:.3e} (fd {fd}, engine {grads[name].flat[idxs]})"


@pytest.mark.parametrize("case", ["gpt2_tied", "llama_gqa", "moe"])
def test_gradient_accumulation_and_partial_batch(case):
    """Two half batches, each of T' = 4 < T positions and weighted 0.5, accumulate into the reference's
    gradients of the two; grad_norm is the reference's norm of them."""
    cfg = CASES[case]
    p = noisy_params(cfg, std=NOISE[cfg.arch])
    eng = engine(cfg, p, 4, cfg.n_ctx)
    tokens, targets, mask = batch(cfg, 4, cfg.n_ctx)
    eng.zero_grad()
    want = {k: np.zeros(v.shape) for k, v in p.items()}
    for lo, hi in ((0, 2), (2, 4)):
        eng.forward(tokens[lo:hi, :4], targets[lo:hi, :4], mask[lo:hi, :4])
        eng.backward(scale=0.5)
        _, _, cache = reference(p, cfg, tokens[lo:hi, :4], targets[lo:hi, :4], mask[lo:hi, :4])
        for k, g in reference_grads(cfg, cache).items():
            want[k] += 0.5 * g
    worst, where = max_rel(eng.get_grads(), want)
    assert worst < 1e-4, f"accumulated grads: max relative diff {worst:.3e} in {where}"
    norm = eng.grad_norm()
    norm_ref = ref.grad_norm(want)
    assert abs(norm - norm_ref) < 1e-5 * norm_ref, f"grad_norm {norm} vs {norm_ref}"


@pytest.mark.parametrize("case", ["gpt2_tied", "gpt2_untied", "llama_gqa", "moe"])
def test_training_follows_reference(case):
    cfg = ModelConfig(**{**CASES[case].__dict__, "n_embd": 16, "n_ff": 24, "n_ctx": 8, "vocab_size": 29})
    p = init_params(cfg, 1)
    eng = engine(cfg, p, 4, 8)
    ref_p = {k: v.astype(np.float64) for k, v in p.items()}
    state: dict = {}
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0)
    for it in range(20):
        tokens, targets, mask = batch(cfg, 4, 8, seed=it)
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        norm = eng.step(**hp)
        loss_ref, aux_ref, cache = reference(ref_p, cfg, tokens, targets, mask)
        ref_p, norm_ref = ref.adamw_step(ref_p, reference_grads(cfg, cache), state, **hp)
        assert abs(loss - loss_ref) < 1e-4 * abs(loss_ref), f"step {it}: loss {loss} vs reference {loss_ref}"
        if cfg.arch == "llama":
            assert abs(eng.aux_loss() - aux_ref) < 1e-4 * max(1.0, aux_ref), f"step {it}: aux {eng.aux_loss()} vs {aux_ref}"
        assert abs(norm - norm_ref) < 1e-3 * norm_ref, f"step {it}: norm {norm} vs reference {norm_ref}"
    worst, where = max_rel(eng.get_params(), ref_p)
    assert worst < 1e-3, f"params after 20 steps: max relative diff {worst:.3e} in {where}"
    st = eng.get_optimizer_state()
    assert st["t"] == 20 and set(st["m"]) == set(p)


DETERMINISM = {
    "gpt2": ModelConfig(vocab_size=31, n_ctx=8, n_embd=16, n_head=4, n_layer=1, n_ff=32),
    "llama": _llama(hkv=1, n_head=4, n_embd=16, n_ff=16, n_ctx=8),
    "moe": _llama(E=4, K=2, hkv=1, n_head=4, n_embd=16, n_ff=16, n_ctx=8),
}


@pytest.mark.parametrize("arch", list(DETERMINISM))
def test_determinism_and_state_roundtrip(arch):
    """Two engines, the same steps: the same bits; parameters and optimizer state restored into a fresh engine:
    the same next step."""
    cfg = DETERMINISM[arch]
    p = init_params(cfg, 2)
    engines = [engine(cfg, p, 3, 8) for _ in range(2)]
    for it in range(4):
        tokens, targets, mask = batch(cfg, 3, 8, seed=it)
        for eng in engines:
            eng.forward(tokens, targets, mask)
            eng.zero_grad()
            eng.backward()
            eng.step(1e-2)
    a, b = (e.get_params() for e in engines)
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs between two identical runs"
    fresh = engine(cfg, engines[0].get_params(), 3, 8)
    fresh.set_optimizer_state(engines[0].get_optimizer_state())
    tokens, targets, mask = batch(cfg, 3, 8, seed=9)
    for eng in (engines[0], fresh):
        eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        eng.step(1e-2)
    a, b = engines[0].get_params(), fresh.get_params()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs after restoring the optimizer state"


@pytest.mark.parametrize("case,launch_row", [("gpt2_untied", ""), ("llama_gqa", ""), ("gpt2_tied", "gpu"),
                                             ("llama_gqa", "nvidia")])
def test_label_smoothing_trains_smoothed_and_measures_plain(case, launch_row):
    """An engine made with label_smoothing 0.1: a forward's loss and the next backward's gradients are the float64
    reference's with that eps (CPU row: the fused kernel; GPU rows: the work-group forward and the plain backward);
    a forward with smoothed=False (the held-out loss) gives the plain loss and gradients."""
    cfg = CASES[case]
    p = noisy_params(cfg, std=NOISE[cfg.arch])
    B, T = 3, cfg.n_ctx
    eng = engine(cfg, p, B, T, knobs=Knobs(launch=launch_row), label_smoothing=0.1)
    tokens, targets, mask = batch(cfg, B, T)
    runs = {}
    for smoothed, eps in ((True, 0.1), (False, 0.0), (True, 0.1)):
        loss = eng.forward(tokens, targets, mask, smoothed=smoothed)
        eng.zero_grad()
        eng.backward()
        loss_ref, _, cache = reference(p, cfg, tokens, targets, mask, label_smoothing=eps)
        assert abs(loss - loss_ref) < 1e-5 * abs(loss_ref), f"smoothed={smoothed}: loss {loss} vs reference {loss_ref}"
        want = reference_grads(cfg, cache)
        worst, where = max_rel(eng.get_grads(), want)
        assert worst < 1e-4, f"smoothed={smoothed}: grads max relative diff {worst:.3e} in {where}"
        runs.setdefault(smoothed, []).append((loss, want))
    assert runs[True][0][0] == runs[True][1][0] and runs[True][0][0] != runs[False][0][0]
    assert max_rel(runs[True][0][1], runs[False][0][1])[0] > 1e-2  # the tolerance above tells the two apart


@pytest.mark.parametrize("eps", [1.0, -0.1, float("nan")])
def test_label_smoothing_outside_zero_to_one_is_refused(eps):
    cfg = CASES["gpt2_untied"]
    with pytest.raises(ClgptError, match=r"^label_smoothing must lie in \[0, 1\), got") as e:
        engine(cfg, init_params(cfg, 0), 1, cfg.n_ctx, label_smoothing=eps)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("eps", [0.0, 0.25])
def test_label_smoothing_zero_builds_only_the_plain_programs(eps):
    """Without label smoothing the loss's kernels are the builds of a model made before it existed (V alone: no
    LS define, so the same programs and bits); with it the smoothed builds come beside them."""
    cfg = CASES["llama"]
    eng = engine(cfg, init_params(cfg, 0), 2, cfg.n_ctx, label_smoothing=eps)
    V, k = cfg.vocab_size, eng.ops.k
    plain = [name for name in k if name.startswith("xent") and not name.endswith("_ls")]
    assert "xent_forward" in plain and "xent_backward" in plain
    for name in plain:
        assert k[name] is eng.dev.kernel("xent", name, V=V), name
    smoothed = sorted(name for name in k if name.endswith("_ls"))
    assert smoothed == ([] if eps == 0 else sorted(name + "_ls" for name in plain))
    for name in smoothed:
        assert k[name] is eng.dev.kernel("xent", name.removesuffix("_ls"), V=V, LS=eps), name


@pytest.mark.parametrize("case", ["gpt2_untied", "llama", "llama_gqa"])
@pytest.mark.parametrize("p_drop", [0.0, 0.2])
def test_portable_flash_attention_on_the_gpu_row_vs_reference(case, p_drop):
    """The generic GPU row with portable flash attention (kernels/flash_portable.cl; llama's RoPE and grouped kv
    heads through rope.cl around it) at T 37, no tile's multiple, with and without attention dropout: loss and
    gradients against the float64 reference, two runs bit for bit alike, logits of partial calls; att and datt
    hold (B,H,T) rows, no T x T buffer. attention auto takes it from tuner_flash.MIN_T on that row, the batched form below; the CPU
    row never."""
    from dataclasses import replace

    from clgpt.bench import device_bytes
    from clgpt.device.tuner_flash import MIN_T
    from enginecheck import assert_two_runs_match_reference

    B, T = 3, 37
    cfg = replace(CASES[case], n_ctx=T)
    p = noisy_params(cfg, std=NOISE[cfg.arch])
    tokens, targets, mask = batch(cfg, B, T, seed=4)
    drop = dict(dropout=(99, p_drop)) if p_drop else {}
    loss_ref, _, cache = reference(p, cfg, tokens, targets, mask, **drop)
    runs = []
    for _ in range(2):
        eng = engine(cfg, p, B, T, knobs=Knobs(launch="gpu"), attention="flash", dropout=p_drop)
        assert eng.ops.flash_portable and eng.ops.att_floats(B, T) == B * cfg.n_head * T
        loss = eng.forward(tokens, targets, mask, **({"dropout_seed": 99} if p_drop else {}))
        eng.zero_grad()
        eng.backward()
        runs.append((loss, eng.get_grads()))
    assert_two_runs_match_reference(runs, loss_ref, reference_grads(cfg, cache))
    for Bp, Tp in ((1, 1), (2, 20)):  # partial calls: B' and T' below the engine's
        got, want = eng.forward(tokens[:Bp, :Tp]), reference_logits(p, cfg, tokens[:Bp, :Tp])
        assert np.abs(got - want).max() < 1e-5, f"({Bp},{Tp}): logits max abs diff {np.abs(got - want).max():.3e}"
    batched = engine(cfg, p, B, T, knobs=Knobs(launch="gpu"), attention="batched", dropout=p_drop)
    L, BHT = cfg.n_layer, B * cfg.n_head * T
    att_d = L * BHT * T if p_drop else 0  # the batched form's dropped probabilities
    assert device_bytes(batched) - device_bytes(eng) == 4 * ((L + 1) * (BHT * T - BHT) + att_d)
    for launch, t, want in (("gpu", MIN_T, True), ("gpu", MIN_T - 1, False), ("cpu", MIN_T, False)):
        c = replace(cfg, n_ctx=t)
        assert engine(c, init_params(c, 0), 1, t, knobs=Knobs(launch=launch)).ops.flash_portable is want


def test_portable_flash_attention_at_bf16_rounds_as_the_batched_form():
    """precision bf16 on the generic GPU row: portable flash attention rounds its products' operands as the
    batched form's GEMM does (ROUND 1), so the two give the loss and every gradient within bf16's tolerance
    (2^-7 relative to each tensor's largest value)."""
    from dataclasses import replace

    B, T = 2, 40
    cfg = replace(CASES["gpt2_untied"], n_ctx=T)
    p = noisy_params(cfg, std=NOISE["gpt2"])
    tokens, targets, mask = batch(cfg, B, T, seed=6)
    res = {}
    for form in ("flash", "batched"):
        eng = engine(cfg, p, B, T, knobs=Knobs(launch="gpu"), attention=form, precision="bf16")
        assert eng.ops.flash_portable is (form == "flash") and eng.ops.round == 1
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        res[form] = loss, eng.get_grads()
    assert abs(res["flash"][0] - res["batched"][0]) < 1e-2 * abs(res["batched"][0])
    worst, where = max_rel(res["flash"][1], res["batched"][1])
    assert worst < 2 ** -7, f"grads: flash vs batched at bf16 {worst:.3e} in {where}"


@pytest.mark.parametrize("case", ["gpt2_tied", "gpt2_untied", "llama_gqa", "moe"])
def test_weight_copies_name_the_weights_the_products_read(case, monkeypatch):
    """The weights an engine hands Ops.weight_copies (on wgmma their tiled copies are made together, one launch a
    forward) are exactly those its products read in a forward and backward, each as the rows and columns the
    products read it as, at the offset of the flat parameter buffer where its values lie."""
    from clgpt.ops import Ops

    cfg = CASES[case]
    handed = []
    monkeypatch.setattr(Ops, "weight_copies", lambda self, M, flat, mats: handed.append((M, flat, mats)))
    eng = engine(cfg, noisy_params(cfg, std=NOISE[cfg.arch]), 2, cfg.n_ctx)
    (M, flat, mats), = handed
    assert M == 2 * cfg.n_ctx
    read, backend = {}, eng.ops.backend
    real = backend.matmul_epi

    def recording(Mm, N, K, A, B, Cm, ta=0, tb=0, *a, **kw):
        for X, shape in ((A, (K, Mm) if ta else (Mm, K)), (B, (N, K) if tb else (K, N))):
            read.setdefault(X.int_ptr, set()).add(shape)
        return real(Mm, N, K, A, B, Cm, ta, tb, *a, **kw)

    monkeypatch.setattr(backend, "matmul_epi", recording)
    tokens, targets, mask = batch(cfg, 2, cfg.n_ctx)
    eng.forward(tokens, targets, mask)
    eng.zero_grad()
    eng.backward()
    weights = {b.int_ptr for b in eng.p.values()}
    assert {X.int_ptr: {(rows, cols)} for X, _, rows, cols in mats} == {h: s for h, s in read.items() if h in weights}
    host = np.empty(flat.size // 4, np.float32)
    cl.enqueue_copy(eng.queue, host, flat, is_blocking=True)
    for X, off, rows, cols in mats:
        values = np.empty(rows * cols, np.float32)
        cl.enqueue_copy(eng.queue, values, X, is_blocking=True)
        assert np.array_equal(host[off: off + rows * cols], values)


@pytest.mark.parametrize("cfg", [ModelConfig(vocab_size=64, n_ctx=64, n_embd=128, n_head=2, n_layer=2, n_ff=256,
                                             bias=False),
                                 _llama(vocab_size=64, n_ctx=64, n_embd=128, n_ff=192, n_head=2)],
                         ids=["gpt2_nobias", "llama"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the loss sums buffers no kernel wrote
def test_wgmma_step_makes_fewer_copy_launches(dev, monkeypatch, cfg):
    """A training step on the wgmma path (no sm_90a here: its kernels recorded, not built or run): the weights'
    tiled copies take one to_bf16_batch launch instead of one to_bf16 each, and the norms' backward writes the
    residual gradient's copies instead of the linear_backwards' reuse blocks (the final norm's and every block's
    but layer 0's attention norm: two a layer): the step's to_bf16 launches fall by that many, and nothing else
    changes but the kernels' forms."""
    from types import SimpleNamespace

    from clgpt.device import capabilities as capmod, sm90a
    from precisioncheck import emulated_knobs

    monkeypatch.setattr(sm90a, "supported", lambda device: True)
    monkeypatch.setattr(capmod, "_cache", {})
    monkeypatch.setattr(capmod, "subgroup_sizes", lambda device: ((), False))  # NVIDIA's: none, and no probe to build
    monkeypatch.setattr(dev, "kernel", lambda stem, name, build_options=(), **d: SimpleNamespace(
        function_name=name, tiled=bool(d.get("DX_TILED"))))
    knobs = emulated_knobs(wgmma_min_mnk=0)
    p = init_params(cfg, 0)
    counts = {}
    for mode in ("one a launch", "together"):
        eng = engine(cfg, p, 2, cfg.n_ctx, knobs=knobs, device=dev, precision="bf16")
        assert eng.ops.wgmma is not None and eng.ops.facts.colsum_copies
        if mode == "one a launch":
            eng.ops.backend.copies.batch(None, [])
            for name in ("rmsnorm_backward", "layernorm_backward"):
                monkeypatch.setattr(eng.ops, name, lambda *a, _f=getattr(eng.ops, name), dx_copy=False, **kw:
                                    _f(*a, **kw))
        names = Counter()
        for meth in ("launch", "launch_plain"):
            monkeypatch.setattr(eng.ops.launcher, meth, lambda kern, *a, **kw: names.update(
                [kern.function_name + ("_dx_tiled" if kern.tiled else "")]))
        tokens, targets, mask = batch(cfg, 2, cfg.n_ctx)
        eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        eng.step(1e-3)
        counts[mode] = names
    before, after = counts["one a launch"], counts["together"]
    weights = 1 + 4 * cfg.n_layer
    assert after["to_bf16_batch"] == 1 and before["to_bf16_batch"] == 0
    assert before["to_bf16"] - after["to_bf16"] == weights + 2 * cfg.n_layer
    norm = "layernorm" if cfg.arch == "gpt2" else "rmsnorm"
    assert after[f"{norm}_backward_rows_dx_tiled"] == 2 * cfg.n_layer and not before[f"{norm}_backward_rows_dx_tiled"]
    assert sum(after.values()) == sum(before.values()) - weights + 1 - 2 * cfg.n_layer
