"""The model's shape and its parameters, named exactly as the GGUF tensors they become.

Shape convention used across clgpt: B batch, T time (sequence), C channels (n_embd), V vocab,
H heads, D head dim (C // H), F feed-forward width (n_ff), L layers.

Every matrix is stored as numpy (out, in) -- the GGUF layout -- so a linear layer is y = x @ W.T + b.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from clgpt.errors import ClgptError


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt2"  # GGUF architecture; only gpt2 is implemented so far
    vocab_size: int = 512  # V: 256 byte tokens + merges + special tokens
    n_ctx: int = 256  # rows of the position table; llama.cpp allocates >= 256 positions
    n_embd: int = 64  # C
    n_head: int = 2  # H; head dim D = C // H
    n_layer: int = 1  # L
    n_ff: int = 256  # F
    tied: bool = True  # output head shares token_embd.weight
    norm_eps: float = 1e-5  # LayerNorm epsilon

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self, where: str = "model") -> None:
        if self.arch != "gpt2":
            raise ClgptError(f"{where}.arch: {self.arch!r} is not supported; use 'gpt2'")
        for key in ("vocab_size", "n_ctx", "n_embd", "n_head", "n_layer", "n_ff"):
            if getattr(self, key) < 1:
                raise ClgptError(f"{where}.{key}: must be at least 1, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ClgptError(
                f"{where}.n_embd: {self.n_embd} is not divisible by {where}.n_head={self.n_head}; "
                "choose n_embd a multiple of n_head"
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every trainable tensor, in a fixed order, by its GGUF name and numpy shape."""
    V, T, C, F = cfg.vocab_size, cfg.n_ctx, cfg.n_embd, cfg.n_ff
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (V, C),
        "position_embd.weight": (T, C),
    }
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (C,)
        shapes[p + "attn_norm.bias"] = (C,)
        shapes[p + "attn_qkv.weight"] = (3 * C, C)  # rows: q (C), k (C), v (C); heads contiguous
        shapes[p + "attn_qkv.bias"] = (3 * C,)
        shapes[p + "attn_output.weight"] = (C, C)
        shapes[p + "attn_output.bias"] = (C,)
        shapes[p + "ffn_norm.weight"] = (C,)
        shapes[p + "ffn_norm.bias"] = (C,)
        shapes[p + "ffn_up.weight"] = (F, C)
        shapes[p + "ffn_up.bias"] = (F,)
        shapes[p + "ffn_down.weight"] = (C, F)
        shapes[p + "ffn_down.bias"] = (C,)
    shapes["output_norm.weight"] = (C,)
    shapes["output_norm.bias"] = (C,)
    if not cfg.tied:
        shapes["output.weight"] = (V, C)
    return shapes


def init_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """GPT-2 initialisation: N(0, 0.02) matrices, residual projections scaled by 1/sqrt(2L),
    LayerNorm weights 1, biases 0. float32, deterministic in the seed."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = np.ones(shape)
        elif name.endswith(".bias"):
            w = np.zeros(shape)
        else:
            std = 0.02
            if name.endswith(("attn_output.weight", "ffn_down.weight")):
                std = 0.02 / np.sqrt(2 * cfg.n_layer)
            w = rng.normal(0.0, std, size=shape)
        params[name] = w.astype(np.float32)
    return params


def decays(name: str) -> bool:
    """AdamW weight decay applies to matrices (2-D tensors), not to norms or biases."""
    return name.endswith(".weight") and "norm" not in name


def num_params(cfg: ModelConfig) -> int:
    return int(sum(np.prod(s) for s in param_shapes(cfg).values()))
