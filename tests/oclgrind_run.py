"""One training step (gpt2's label-smoothed), one generation step and one cached decoding step of every architecture
at a tiny shape, on the device named by argv[1] (the Oclgrind simulator in tests/test_oclgrind.py, which reports
memory errors, races and barrier divergence on stderr) with the matmuls' precision argv[2]. CLGPT_LAUNCH picks the
CPU, GPU or NVIDIA kernels (the last with tensor-core instructions emulated). Prints "ok" at the end."""

import sys

import numpy as np

from clgpt.inference.kvcache import KVCache
from clgpt.model import ModelConfig, init_params
from clgpt.models.factory import make_engine
from clgpt.device.knobs import read as read_knobs

SHAPES = [
    dict(arch="gpt2", vocab_size=19, n_ctx=8, n_embd=32, n_head=2, n_layer=1, n_ff=64),
    dict(arch="llama", vocab_size=19, n_ctx=8, n_embd=32, n_head=4, n_head_kv=2, n_layer=1, n_ff=48),
    dict(arch="llama", vocab_size=19, n_ctx=8, n_embd=32, n_head=2, n_layer=1, n_ff=32, n_expert=4,
         n_expert_used=2),
]


def main(device: str, precision: str) -> None:
    rng = np.random.default_rng(0)
    B, T = 2, 8
    for shape in SHAPES:
        cfg = ModelConfig(**shape)
        # gpt2 trains label-smoothed (xent.cl's -D LS builds), the others on the plain loss
        eng = make_engine(cfg, init_params(cfg, 0), batch_size=B, seq_len=T, device=device, dropout=0.1,
                          attention="flash" if precision == "bf16" else "auto",
                          precision=precision, knobs=read_knobs(),
                          label_smoothing=0.1 if shape["arch"] == "gpt2" else 0.0)
        tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
        targets = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
        loss = eng.forward(tokens, targets, np.ones((B, T), np.float32), dropout_seed=1)
        eng.zero_grad()
        eng.backward()
        eng.step(1e-3)
        logits = eng.next_logits(tokens[:1, :5], [4])
        cache = KVCache(eng)  # decoding with the key/value cache: a prefill, then a step at its own position
        cache.prefill(tokens[:, :4], [3, 1])
        stepped = cache.step(tokens[:, 4], [4, 2])
        assert np.isfinite(loss) and np.isfinite(logits).all() and np.isfinite(stepped).all(), shape
        print(shape["arch"], shape.get("n_expert", 0), float(loss), flush=True)
    from clgpt.device.opencl import get_device

    print("families:", " ".join(sorted({stem for stem, _ in get_device(device)._programs})))
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
