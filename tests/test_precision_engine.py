"""The engines with each precision: the tensor-core products and attention against float64, loss,
gradients and determinism per precision, fp32 unchanged, a reduced-precision training curve tracking fp32,
and the llama engine (dense, grouped-query, experts) on the tensor cores."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference as ref
from clgpt.models.gpt2 import GPT2Engine

from conftest import from_dev, to_dev
from precisioncheck import ROUNDED_TOL, _engine, assert_bf16_step, assert_scaled, emulated_knobs, operands

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(4321)


@pytest.mark.parametrize("precision,ta,tb,M,N,K", [("bf16", 1, 0, 40, 37, 1100), ("bf16", 0, 0, 130, 70, 40),
                                                   ("tf32", 1, 0, 40, 37, 1100)])
def test_engine_tensor_core_path(dev, precision, ta, tb, M, N, K):
    """Engine.matmul through the mma kernel (emulated): split-K for the deep product, tiles otherwise."""
    eng = _engine(precision, launch="nvidia", emulate=True)
    assert eng.mma is not None
    A, B = operands(ta, tb, M, N, K)
    C0 = rng.normal(size=(M, N)).astype(f32)
    rnd = ref.ROUNDERS[precision]
    opA, opB = rnd(A.T if ta else A).astype(np.float64), rnd(B.T if tb else B).astype(np.float64)
    cbuf = to_dev(dev, C0)
    eng.matmul(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, ta=ta, tb=tb, accum=True, alpha=0.5)
    scale = 0.5 * np.abs(opA) @ np.abs(opB) + np.abs(C0)
    assert_scaled(from_dev(dev, cbuf, (M, N)), 0.5 * opA @ opB + C0, scale, ROUNDED_TOL, f"engine mma {precision}")


def test_engine_tensor_core_attention(dev):
    """GPU attention (batched causal products) on the mma kernel (emulated) with bf16 operands."""
    B, T, C, H = 2, 40, 16, 2
    eng = _engine("bf16", launch="nvidia", emulate=True, B=B, T=T, C=C, H=H)
    eng.ops.facts.attn_gemm = True
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    want, _ = ref.attention_forward(qkv, H)
    ob, ab = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, B * T * C * 4), cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, B * H * T * T * 4)
    eng.ops.attention_forward(B, T, to_dev(dev, qkv), ob, ab)
    got = from_dev(dev, ob, (B, T, C))
    err = np.abs(got - want).max()
    assert 1e-5 < err < 3e-2, f"bf16 attention: max error {err:.2e} (expected bf16's, not fp32's or worse)"


def _losses_and_grads(precision, steps=0, **kw):
    eng = _engine(precision, V=32, T=16, C=32, H=2, F=64, B=2, L=2, **kw)
    r = np.random.default_rng(7)
    tok = r.integers(0, 32, size=(2, 16)).astype(np.int32)
    tgt = r.integers(0, 32, size=(2, 16)).astype(np.int32)
    loss = eng.forward(tok, tgt)
    eng.zero_grad()
    eng.backward()
    grads = eng.get_grads()
    return eng, loss, grads, tok, tgt


@pytest.mark.parametrize("launch,precision", [("cpu", "bf16"), ("cpu", "tf32"), ("nvidia", "bf16")])
def test_engine_precision_loss_grads_and_determinism(dev, launch, precision):
    """Loss and grads of a reduced-precision engine (portable kernels) against the float64 reference, within a
    band that fp32 meets 100x tighter; and the same bytes run to run."""
    eng, loss, grads, tok, tgt = _losses_and_grads(precision, launch=launch)
    want_loss, cache = ref.gpt_forward(init_params(eng.cfg, 0), eng.cfg, tok, tgt)
    want_grads = ref.gpt_backward(cache)
    band = 2e-2 if precision == "bf16" else 5e-3
    assert abs(loss - want_loss) < band * abs(want_loss), f"{precision} loss {loss} vs {want_loss}"
    for name, g in want_grads.items():
        err = np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-12)
        assert err < 10 * band, f"{precision} grad {name}: relative error {err:.2e}"
    _, loss2, grads2, _, _ = _losses_and_grads(precision, launch=launch)
    assert loss2 == loss and all(np.array_equal(grads[n], grads2[n]) for n in grads)


def test_engine_fp32_is_unchanged(dev):
    """precision fp32 is the engine as it was: same loss and gradient bytes as the default."""
    cfg = ModelConfig(vocab_size=32, n_ctx=16, n_embd=32, n_head=2, n_layer=1, n_ff=64)
    r = np.random.default_rng(3)
    tok, tgt = (r.integers(0, 32, size=(2, 16)).astype(np.int32) for _ in range(2))
    out = []
    for kw in (dict(), dict(precision="fp32"), dict(precision="auto")):  # auto: PoCL has no matrix path
        eng = GPT2Engine(cfg, init_params(cfg, 0), batch_size=2, seq_len=16, knobs=Knobs(launch="cpu"), **kw)
        assert eng.round == 0 and eng.mma is None
        loss = eng.forward(tok, tgt)
        eng.zero_grad()
        eng.backward()
        out.append((loss, eng.get_grads()))
    for loss, g in out[1:]:
        assert loss == out[0][0] and all(np.array_equal(g[n], out[0][1][n]) for n in g)


def test_training_curve_reduced_precision_tracks_fp32(dev):
    """60 AdamW steps on a fixed small set: bf16 and tf32 losses stay within 0.05 nats of fp32's at every
    step past the first 10, and all three learn (the loss falls by over 1 nat)."""
    cfg = ModelConfig(vocab_size=32, n_ctx=16, n_embd=32, n_head=2, n_layer=1, n_ff=64)
    r = np.random.default_rng(11)
    data = [(r.integers(0, 8, size=(4, 16)).astype(np.int32),) for _ in range(2)]
    data = [(t, np.roll(t, -1, axis=1)) for (t,) in data]  # learnable: the next token of a short cycle
    curves = {}
    for precision in ("fp32", "bf16", "tf32"):
        eng = GPT2Engine(cfg, init_params(cfg, 0), batch_size=4, seq_len=16, precision=precision, knobs=Knobs(launch="cpu"))
        losses = []
        for step in range(60):
            tok, tgt = data[step % 2]
            losses.append(eng.forward(tok, tgt))
            eng.zero_grad()
            eng.backward()
            eng.step(3e-3)
        curves[precision] = np.array(losses)
    assert curves["fp32"][0] - curves["fp32"][-1] > 1.0
    for precision in ("bf16", "tf32"):
        gap = np.abs(curves[precision][10:] - curves["fp32"][10:]).max()
        assert gap < 0.05, f"{precision}: {gap:.3f} nats from fp32"
        assert curves[precision][0] - curves[precision][-1] > 1.0


@pytest.mark.parametrize("shape", [dict(), dict(n_head=4, n_head_kv=2), dict(n_expert=4, n_expert_used=2)])
def test_llama_engine_on_tensor_cores_against_float64(dev, shape):
    """llama's bf16 engine with every product on the tensor-core kernels (emulated), the SwiGLU backward's
    two-output epilogue (EPI 3, rows 2F apart) among them, dense, grouped-query and MoE: loss and every gradient
    against the float64 reference (MoE with the engine's routing: top-k may pick differently at a near tie; its
    grouped products on matmul_mma with GROUP 1 and 2, bf16 as the dense ones), and the same bytes twice."""
    from clgpt.models import reference_llama
    from clgpt.models.factory import make_engine

    cfg = ModelConfig(**{**dict(arch="llama", vocab_size=32, n_ctx=16, n_embd=32, n_head=2, n_layer=2, n_ff=64),
                         **shape})
    params = init_params(cfg, 0)
    r = np.random.default_rng(7)
    tok, tgt = (r.integers(0, 32, size=(2, 16)).astype(np.int32) for _ in range(2))
    runs = []
    for _ in range(2):
        eng = make_engine(cfg, params, batch_size=2, seq_len=16, precision="bf16", knobs=emulated_knobs())
        assert eng.ops.bf16 is not None
        eng.zero_grad()
        loss = eng.forward(tok, tgt)
        eng.backward()
        runs.append((loss, eng.get_grads()))
    if cfg.n_expert:  # MmaGemm.kernel's keys end (group, groups); no grouped product left on kernels/matmul.cl
        assert {key[-2:] for key in eng.ops.product_kernels if key[0] == "mma" and key[-2]} == {(1, 4), (2, 4)}
        assert not any(key[0] == "grouped" for key in eng.ops.product_kernels)
    routing = None
    if cfg.n_expert:
        routing = [from_dev(dev, a["sel"], (tok.size, cfg.n_expert_used)).view(np.int32) for a in eng.acts]
    want_loss, _, cache = reference_llama.llama_forward(params, cfg, tok, tgt, routing=routing)
    want = reference_llama.llama_backward(cache)
    assert_bf16_step(runs, want_loss, want)


def _storage_run(cfg, storage: bool, steps=2):
    """Steps of a bf16 engine on the generic GPU row with bf16 storage on or off (fp32 operands rounded as they
    load) -> (losses, grads, params, per step the buffers copied and the operands the products read)."""
    from collections import Counter

    from clgpt.models.factory import make_engine

    eng = make_engine(cfg, init_params(cfg, 5), batch_size=2, seq_len=cfg.n_ctx, precision="bf16",
                      dropout=0.1 if cfg.arch == "gpt2" else 0.0, knobs=Knobs(launch="gpu"))
    ops = eng.ops
    assert ops.gemm == "portable" and ops.facts.bf16_storage
    ops.facts.bf16_storage = storage
    copied, reads = Counter(), [0]
    to_bf16, plain_copy = ops.backend.to_bf16, ops.backend.copies.plain_copy

    def count_copy(slot, X, *a, **k):
        copied[X.int_ptr] += 1
        return to_bf16(slot, X, *a, **k)

    def count_read(*a, **k):
        reads[0] += 1
        return plain_copy(*a, **k)
    ops.backend.to_bf16, ops.backend.copies.plain_copy = count_copy, count_read
    r = np.random.default_rng(8)
    out, counts = [], []
    for step in range(steps):
        tok, tgt = (r.integers(0, cfg.vocab_size, size=(2, cfg.n_ctx)).astype(np.int32) for _ in range(2))
        copied.clear()
        reads[0] = 0
        loss = eng.forward(tok, tgt, dropout_seed=1234 + step)
        eng.zero_grad()
        eng.backward()
        out.append((loss, eng.get_grads()))
        counts.append((dict(copied), reads[0]))
        eng.step(3e-3)
    weights = {b.int_ptr for b in eng.p.values()}
    return out, eng.get_params(), counts, weights


@pytest.mark.parametrize("arch", ["gpt2", "llama_gqa", "moe"])
def test_gpu_row_bf16_storage_same_bits_half_the_bytes(dev, arch):
    """precision bf16 on the generic GPU row (no tensor cores): the products on bf16 copies of their operands give
    the loss, gradients and updated weights of the products rounding fp32 operands as they load, bit for bit;
    each weight is copied once a step (it serves the forward's and the backward's products), and fewer copies are
    made than operands read."""
    cfg = {"gpt2": ModelConfig(vocab_size=23, n_ctx=8, n_embd=16, n_head=2, n_layer=2, n_ff=32),
           "llama_gqa": ModelConfig(arch="llama", vocab_size=23, n_ctx=8, n_embd=16, n_head=4, n_head_kv=2,
                                    n_layer=2, n_ff=24, tied=False),
           "moe": ModelConfig(arch="llama", vocab_size=23, n_ctx=8, n_embd=16, n_head=2, n_head_kv=1, n_layer=1,
                              n_ff=24, n_expert=4, n_expert_used=2, tied=False)}[arch]
    stored, p_stored, counts, weights = _storage_run(cfg, True)
    loaded, p_loaded, off_counts, _ = _storage_run(cfg, False)
    assert all(c == ({}, 0) for c in off_counts)  # off: no copies at all
    for (l1, g1), (l2, g2) in zip(stored, loaded):
        assert l1 == l2, f"{arch}: loss {l1} vs {l2}"
        for n in g2:
            assert np.array_equal(g1[n], g2[n]), f"{arch}: grad {n} differs with bf16 storage"
    for n in p_loaded:
        assert np.array_equal(p_stored[n], p_loaded[n]), f"{arch}: {n} differs after the steps"
    for copied, reads in counts:
        assert reads > 0 and sum(copied.values()) < reads, (copied, reads)
        twice = [h for h in weights if copied.get(h, 0) > 1]
        assert not twice, f"{arch}: {len(twice)} weights copied more than once a step"
        assert any(h in copied for h in weights)
