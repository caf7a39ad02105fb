"""Dropout: the counter-hash masks (clgpt.models.dropout, kernels/dropout.cl), the engines with dropout against the
float64 references drawing the same masks, finite differences through the engine with the masks fixed by the
seed, determinism, and dropout off where it must be (no seed, no targets: evaluation and generation).

Tolerances as the engine tests: loss 1e-5 relative, gradients 1e-4 of each tensor's largest, float32 finite
differences (eps 1e-2) 2e-3 + 2e-2 of the largest difference."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from clgpt.device.opencl import get_device
from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig
from clgpt.models import reference as ref
from clgpt.models import reference_llama as ref_llama
from clgpt.models.dropout import dropout_seed, keep_mask, site
from clgpt.models.factory import make_engine
from clgpt.models.reference import fd_entries
from enginecheck import batch, max_rel, noisy_params

CFGS = {
    "gpt2": ModelConfig(vocab_size=23, n_ctx=6, n_embd=16, n_head=2, n_layer=2, n_ff=24),
    "llama": ModelConfig(arch="llama", vocab_size=23, n_ctx=6, n_embd=16, n_head=4, n_head_kv=2, n_layer=2, n_ff=24,
                         tied=False),
    "moe": ModelConfig(arch="llama", vocab_size=23, n_ctx=6, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_expert=4,
                       n_expert_used=2, moe_aux_loss=0.05),
}
P = 0.3
def reference(cfg, p, tokens, targets, mask, drop, routing=None):
    """-> (objective, grads) of the float64 reference with dropout (seed, p) or None."""
    if cfg.arch == "gpt2":
        loss, cache = ref.gpt_forward(p, cfg, tokens, targets, mask, drop)
        return loss, ref.gpt_backward(cache)
    loss, aux, cache = ref_llama.llama_forward(p, cfg, tokens, targets, mask, routing, drop)
    return loss + cfg.moe_aux_loss * aux, ref_llama.llama_backward(cache)

def test_dropout_seed_formula():
    assert dropout_seed(0, 0, 0) == 0
    assert dropout_seed(1234, 7, 1) == ((1234 * 0x9E3779B1) ^ (7 * 0x85EBCA77) ^ 0xC2B2AE3D) & 0xFFFFFFFF
    seeds = {dropout_seed(1, s, m) for s in range(50) for m in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**32 for s in seeds)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_dropout_kernels_match_the_numpy_mask(p):
    """The three kernels keep exactly keep_mask's elements, scale by 1/(1-p), and drop about p of them."""
    rng = np.random.default_rng(3)
    dev = get_device()
    n, seed, s = 10007, 0xDEADBEEF, site(3, "attn_res")
    x, y = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    keep = keep_mask(seed, s, (n,), p)
    assert abs((~keep).mean() - p) < 0.02
    mf = cl.mem_flags
    bufs = [cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=a) for a in (x, y, np.zeros(n, np.float32))]
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    want = {"dropout_forward": np.where(keep, x * scale, 0), "dropout_residual": x + np.where(keep, y * scale, 0),
            "dropout_backward": np.where(keep, x * scale, 0)}
    for name, w in want.items():
        k = dev.kernel("dropout", name)
        args = (bufs[0], bufs[1], bufs[2]) if name == "dropout_residual" else (bufs[0], bufs[2])
        k(dev.queue, (n,), None, np.int32(n), np.uint32(seed), np.uint32(s), np.float32(p), *args)
        out = np.empty(n, np.float32)
        cl.enqueue_copy(dev.queue, out, bufs[2], is_blocking=True)
        assert np.array_equal(out != 0, keep if name != "dropout_residual" else out != 0)
        assert np.abs(out - w).max() <= 1e-6 * max(1.0, np.abs(w).max()), name
    # sites and seeds draw independent masks
    other = keep_mask(seed, site(3, "ffn_res"), (n,), 0.5), keep_mask(seed + 1, s, (n,), 0.5)
    assert all(0.4 < (keep_mask(seed, s, (n,), 0.5) == o).mean() < 0.6 for o in other)


@pytest.mark.parametrize("launch", ["", "nvidia"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "moe"])
def test_engine_with_dropout_vs_reference(arch, launch):
    """Loss and gradients with dropout against the float64 reference with the same masks; on this device's
    launch row and on the GPU row (batched attention, row kernels, split-K)."""
    cfg = CFGS[arch]
    p = noisy_params(cfg)
    tokens, targets, mask = batch(cfg, 3, 6)
    eng = make_engine(cfg, p, batch_size=3, seq_len=6, dropout=P, knobs=Knobs(launch=launch))
    seed = dropout_seed(1234, 5, 1)
    loss = eng.forward(tokens, targets, mask, dropout_seed=seed)
    eng.zero_grad()
    eng.backward()
    routing = ref_llama.routing_of(ref_llama.llama_forward(p, cfg, tokens, targets, mask, None, (seed, P))[2]) \
        if cfg.n_expert else None
    want_obj, want_g = reference(cfg, p, tokens, targets, mask, (seed, P), routing)
    got_obj = loss + (cfg.moe_aux_loss * eng.aux_loss() if cfg.n_expert else 0.0)
    assert abs(got_obj - want_obj) < 1e-5 * abs(want_obj), f"loss {got_obj} vs reference {want_obj}"
    worst, where = max_rel(eng.get_grads(), want_g)
    assert worst < 1e-4, f"grads: max relative diff {worst:.3e} in {where}"
    no_drop, _ = reference(cfg, p, tokens, targets, mask, None, routing)
    assert abs(want_obj - no_drop) > 1e-3, "the masks changed nothing"


@pytest.mark.parametrize("arch", ["gpt2", "llama", "moe"])
def test_engine_dropout_grads_vs_finite_differences(arch):
    cfg = CFGS[arch]
    p = noisy_params(cfg, std=0.3)
    eng = make_engine(cfg, p, batch_size=2, seq_len=5, dropout=P, knobs=Knobs())
    tokens, targets, mask = batch(cfg, 2, 5, seed=3)
    seed = dropout_seed(7, 1, 0)
    eng.forward(tokens, targets, mask, dropout_seed=seed)
    eng.zero_grad()
    eng.backward()
    grads = eng.get_grads()
    if cfg.n_expert:
        eng.freeze_routing(True)

    def f(q):
        eng.set_params(q)
        loss = eng.forward(tokens, targets, mask, dropout_seed=seed)
        return loss + (cfg.moe_aux_loss * eng.aux_loss() if cfg.n_expert else 0.0)

    rng = np.random.default_rng(1)
    for name in p:
        idxs = rng.choice(p[name].size, size=min(3, p[name].size), replace=False)
        fd = fd_entries(f, p, name, idxs, 1e-2)
        diff = np.abs(grads[name].flat[idxs] - fd).max()
        assert diff < 2e-3 + 2e-2 * np.abs(fd).max(), f"{name}: max abs diff {diff:.3e} (fd {fd})"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dropout_is_deterministic_and_off_without_seed_or_targets(arch):
    cfg = CFGS[arch]
    p = noisy_params(cfg)
    tokens, targets, mask = batch(cfg, 3, 6, seed=2)
    plain = make_engine(cfg, p, batch_size=3, seq_len=6, knobs=Knobs())
    engines = [make_engine(cfg, p, batch_size=3, seq_len=6, dropout=P, knobs=Knobs()) for _ in range(2)]
    runs = []
    for eng in engines:
        loss = eng.forward(tokens, targets, mask, dropout_seed=99)
        eng.zero_grad()
        eng.backward()
        runs.append((loss, eng.get_grads()))
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        assert np.array_equal(runs[0][1][k], runs[1][1][k]), k
    assert engines[0].forward(tokens, targets, mask, dropout_seed=100) != runs[0][0]
    # off: no seed (evaluation), no targets (generation): exactly the engine without dropout
    assert engines[0].forward(tokens, targets, mask) == plain.forward(tokens, targets, mask)
    assert np.array_equal(engines[0].forward(tokens), plain.forward(tokens))
