"""Dropout masks: counter-based, so runs are bit-identical and a resume replays the same masks.

The trainer derives one uint32 per micro-batch, `dropout_seed(seed, step, micro)`; the engine's kernels
(kernels/dropout.cl) keep element i of site s when u(seed, s, i) >= p, u = (h >> 8) / 2^24 with h the hash
below. `keep_mask` computes the same mask in numpy for the float64 references. Sites: `site(-1, "embd")` for
the embeddings' output, then per layer `site(i, "attn")` (attention probabilities, index over (B',H,T',T')),
`site(i, "attn_res")` (attn_output's branch) and `site(i, "ffn_res")` (ffn_down's branch), index over (B'T', C).
"""

from __future__ import annotations

import numpy as np

_KINDS = ("attn", "attn_res", "ffn_res")
_M = 0xFFFFFFFF


def dropout_seed(seed: int, step: int, micro: int) -> int:
    """The uint32 the trainer passes as eng.forward(..., dropout_seed=) for optimizer step `step`, micro-batch `micro`."""
    return ((seed * 0x9E3779B1) ^ (step * 0x85EBCA77) ^ (micro * 0xC2B2AE3D)) & _M


def site(layer: int, kind: str) -> int:
    """The site id of a dropout: 0 for the embeddings (layer -1, kind "embd"), 1 + 3*layer + k per block."""
    if kind == "embd":
        return 0
    return 1 + 3 * layer + _KINDS.index(kind)


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def keep_mask(seed: int, site_id: int, shape, p: float) -> np.ndarray:
    """bool array of `shape`: element i (C order) kept, exactly as kernels/dropout.cl decides."""
    n = int(np.prod(shape))
    with np.errstate(over="ignore"):
        k = _fmix32(np.array([(seed ^ ((site_id * 0x85EBCA6B + 0x27D4EB2F) & _M)) & _M], np.uint32))
        h = _fmix32(k ^ _fmix32(np.arange(n, dtype=np.uint32)))
    u = (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return (u >= np.float32(p)).reshape(shape)


def scale_mask(seed: int, site_id: int, shape, p: float) -> np.ndarray:
    """float64 keep / (1 - p): what the references multiply by."""
    return keep_mask(seed, site_id, shape, p).astype(np.float64) / (1.0 - p)
