"""Every architecture's bf16 engine on the GPU against float64: loss and every gradient, with each product on
the tensor cores (wgmma_min_mnk=0 on sm_90: even the small ones on wgmma), attention batched and as flash
attention (llama's RoPE then inside flash's copy and stores), and the same bytes twice.

    python bench/gpu_engine_check.py       # prints one line per model, then `check: passed` or `check: FAILED`

The float64 references are clgpt/models/reference.py (gpt2) and clgpt/models/reference_llama.py (llama, MoE), written
apart from the kernels. The band is tests/test_precision_engine.py's for bf16: loss within 2%, each gradient's largest error
within 20% of its largest entry.
"""
import dataclasses
import os
import sys

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
from clgpt.device.opencl import get_device  # noqa: E402
from clgpt.device.knobs import read as read_knobs  # noqa: E402
from clgpt.model import ModelConfig, init_params  # noqa: E402
from clgpt.models import reference as ref  # noqa: E402
from clgpt.models import reference_llama as ref_llama  # noqa: E402
from clgpt.models.factory import make_engine  # noqa: E402

MODELS = {  # widths multiples of 64, so every tiled path (kept copies, tiled outputs, EPI 3) is taken
    "gpt2": dict(arch="gpt2", vocab_size=320, n_ctx=128, n_embd=128, n_ff=512, n_head=2, n_layer=2),
    "llama": dict(arch="llama", vocab_size=320, n_ctx=128, n_embd=128, n_ff=384, n_head=2, n_layer=2),
    "llama-gqa": dict(arch="llama", vocab_size=320, n_ctx=128, n_embd=128, n_ff=384, n_head=4, n_head_kv=2,
                      n_layer=2),
    "moe": dict(arch="llama", vocab_size=320, n_ctx=128, n_embd=128, n_ff=256, n_head=2, n_layer=2, n_expert=4,
                n_expert_used=2),
}


def run(cfg, params, tok, tgt, precision, attention):
    eng = make_engine(cfg, params, batch_size=tok.shape[0], seq_len=tok.shape[1], device=dev, precision=precision,
                      knobs=KNOBS, attention=attention)
    eng.zero_grad()
    loss = eng.forward(tok, tgt)
    eng.backward()
    return eng, loss, eng.get_grads()


def reference(eng, cfg, params, tok, tgt):
    """float64 loss and gradients; MoE with the engine's routing (top-k is discrete: a near tie may pick
    another expert in bf16)."""
    if cfg.arch == "gpt2":
        loss, cache = ref.gpt_forward(params, cfg, tok, tgt)
        return loss, ref.gpt_backward(cache)
    routing = None
    if cfg.n_expert:
        routing = []
        for a in eng.acts:
            sel = np.empty(tok.size * cfg.n_expert_used, np.int32)
            cl.enqueue_copy(eng.queue, sel, a["sel"], is_blocking=True)
            routing.append(sel.reshape(tok.size, cfg.n_expert_used))
    loss, _, cache = ref_llama.llama_forward(params, cfg, tok, tgt, routing=routing)
    return loss, ref_llama.llama_backward(cache)


dev = get_device()
KNOBS = dataclasses.replace(read_knobs(), wgmma_min_mnk=0)  # the environment's, every bf16 product on wgmma
print("device:", dev.name, flush=True)
ok = True
for (name, kw), attention in ((m, a) for m in MODELS.items() for a in ("batched", "flash")):
    cfg = ModelConfig(**kw)
    params = init_params(cfg, 0)
    rng = np.random.default_rng(1)
    tok = rng.integers(0, cfg.vocab_size, (4, cfg.n_ctx)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab_size, (4, cfg.n_ctx)).astype(np.int32)
    eng, loss, grads = run(cfg, params, tok, tgt, "bf16", attention)
    paths = f"wgmma={eng.ops.wgmma is not None} flash={eng.ops.flash}"
    if cfg.n_expert:
        paths += f" gate|up={eng.ops.moe_tiled(eng.R)}"
    want_loss, want = reference(eng, cfg, params, tok, tgt)
    worst = max((np.abs(grads[n] - g).max() / max(np.abs(g).max(), 1e-12), n) for n, g in want.items())
    _, loss2, grads2 = run(cfg, params, tok, tgt, "bf16", attention)
    same = loss2 == loss and all(np.array_equal(grads[n], grads2[n]) for n in grads)
    good = abs(loss - want_loss) < 2e-2 * abs(want_loss) and worst[0] < 0.2 and same
    ok &= good
    print(f"{name}: {paths} loss {loss:.5f} vs float64 {want_loss:.5f}, worst grad {worst[1]} {worst[0]:.2e}, "
          f"rerun identical {same}: {'ok' if good else 'FAILED'}", flush=True)
print("check:", "passed" if ok else "FAILED")
sys.exit(0 if ok else 1)
