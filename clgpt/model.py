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


def usual_n_ff(arch: str, n_embd: int) -> int:
    """The feed-forward width each architecture is usually built with: gpt2 4 C; llama 2/3 of that, rounded up to
    a multiple of 32 (llama2.c's rule), so that its three SwiGLU matrices hold what gpt2's two do: the same
    parameters and matmul FLOPs at the same n_embd."""
    if arch == "llama":
        return -(-8 * n_embd // (3 * 32)) * 32
    return 4 * n_embd


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt2"  # GGUF architecture: gpt2 (LayerNorm, GELU, position table) or llama (see below)
    vocab_size: int = 512  # V: 256 byte tokens + merges + special tokens
    n_ctx: int = 256  # rows of the position table; llama.cpp allocates >= 256 positions
    n_embd: int = 64  # C
    n_head: int = 2  # H; head dim D = C // H
    n_layer: int = 1  # L
    n_ff: int = 256  # F; 0 = the architecture's usual width (usual_n_ff)
    tied: bool = True  # output head shares token_embd.weight
    bias: bool = True  # gpt2: False keeps every *.bias at zero and out of training (nanoGPT's bias=False)
    norm_eps: float = 1e-5  # LayerNorm epsilon (gpt2), RMSNorm epsilon (llama)
    # llama only: RMSNorm, RoPE (adjacent pairs), SwiGLU, no biases, separate Q/K/V; n_ctx is then the
    # context it was trained for (no position table), not a hard limit.
    n_head_kv: int = 0  # key/value heads (grouped-query attention); 0 means n_head
    rope_base: float = 10000.0  # RoPE theta_i = rope_base^(-2i/D)
    n_expert: int = 0  # E: experts per feed-forward (mixture of experts); 0 = one dense SwiGLU
    n_expert_used: int = 0  # k: experts each token routes to (top-k of the router softmax)
    moe_aux_loss: float = 0.01  # coefficient of the load-balancing loss E * sum_e f_e P_e (0 = off)

    def __post_init__(self):
        if self.n_ff == 0:
            object.__setattr__(self, "n_ff", usual_n_ff(self.arch, self.n_embd))

    @property
    def kv_heads(self) -> int:
        return self.n_head_kv or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self, where: str = "model") -> None:
        if self.arch not in ("gpt2", "llama"):
            raise ClgptError(f"{where}.arch: {self.arch!r} is not supported; use 'gpt2' or 'llama'")
        for key in ("vocab_size", "n_ctx", "n_embd", "n_head", "n_layer", "n_ff"):
            if getattr(self, key) < 1:
                raise ClgptError(f"{where}.{key}: must be at least 1, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ClgptError(
                f"{where}.n_embd: {self.n_embd} is not divisible by {where}.n_head={self.n_head}; "
                "choose n_embd a multiple of n_head"
            )
        if self.arch == "gpt2":
            for key, default in (("n_head_kv", 0), ("n_expert", 0), ("n_expert_used", 0)):
                if getattr(self, key) != default:
                    raise ClgptError(f"{where}.{key}: only the llama arch has it; set model.arch: llama or drop it")
            return
        if self.head_dim % 2:
            raise ClgptError(
                f"{where}.n_embd: RoPE rotates pairs of channels, so the head dim n_embd/n_head = {self.head_dim} "
                "must be even"
            )
        if self.n_head_kv < 0 or self.n_head % self.kv_heads:
            raise ClgptError(
                f"{where}.n_head_kv: {self.n_head_kv} must divide n_head={self.n_head} (0 means n_head)"
            )
        if not self.rope_base > 1:
            raise ClgptError(f"{where}.rope_base: must be above 1, got {self.rope_base}")
        if self.n_expert < 0 or self.n_expert == 1:
            raise ClgptError(f"{where}.n_expert: {self.n_expert}; use 0 (dense) or at least 2 experts")
        if self.n_expert and not 1 <= self.n_expert_used <= self.n_expert:
            raise ClgptError(
                f"{where}.n_expert_used: {self.n_expert_used} must lie in 1..n_expert={self.n_expert}"
            )
        if not self.n_expert and self.n_expert_used:
            raise ClgptError(f"{where}.n_expert_used: {self.n_expert_used} needs n_expert >= 2")
        if self.moe_aux_loss < 0:
            raise ClgptError(f"{where}.moe_aux_loss: must be >= 0, got {self.moe_aux_loss}")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        if d["bias"]:  # written only when off: models from before the setting keep their bytes
            del d["bias"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every trainable tensor, in a fixed order, by its GGUF name and numpy shape."""
    if cfg.arch == "llama":
        return _llama_shapes(cfg)
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


def _llama_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """llama: no biases, no position table; Q (C,C), K/V (Hkv*D, C); MoE stacks the experts on axis 0."""
    V, C, F, E = cfg.vocab_size, cfg.n_embd, cfg.n_ff, cfg.n_expert
    Ckv = cfg.kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, C)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (C,)
        shapes[p + "attn_q.weight"] = (C, C)  # head h at rows h*D..(h+1)*D-1, RoPE pairs (2i, 2i+1)
        shapes[p + "attn_k.weight"] = (Ckv, C)
        shapes[p + "attn_v.weight"] = (Ckv, C)
        shapes[p + "attn_output.weight"] = (C, C)
        shapes[p + "ffn_norm.weight"] = (C,)
        if E:
            shapes[p + "ffn_gate_inp.weight"] = (E, C)  # router
            shapes[p + "ffn_gate_exps.weight"] = (E, F, C)
            shapes[p + "ffn_up_exps.weight"] = (E, F, C)
            shapes[p + "ffn_down_exps.weight"] = (E, C, F)
        else:
            shapes[p + "ffn_gate.weight"] = (F, C)
            shapes[p + "ffn_up.weight"] = (F, C)
            shapes[p + "ffn_down.weight"] = (C, F)
    shapes["output_norm.weight"] = (C,)
    if not cfg.tied:
        shapes["output.weight"] = (V, C)
    return shapes


def init_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """GPT-2 initialisation (llama too): N(0, 0.02) matrices, residual projections scaled by 1/sqrt(2L),
    norm weights 1, biases 0. float32, deterministic in the seed."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = np.ones(shape)
        elif name.endswith(".bias"):
            w = np.zeros(shape)
        else:
            std = 0.02
            if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight")):
                std = 0.02 / np.sqrt(2 * cfg.n_layer)
            w = rng.normal(0.0, std, size=shape)
        params[name] = w.astype(np.float32)
    return params


def trains(cfg: ModelConfig):
    """-> the predicate of the tensors training updates: all, or (gpt2 with bias off) all but the biases."""
    if cfg.bias or cfg.arch != "gpt2":
        return lambda name: True
    return lambda name: not name.endswith(".bias")


def decays(name: str) -> bool:
    """AdamW weight decay applies to matrices (2-D tensors), not to norms or biases."""
    return name.endswith(".weight") and "norm" not in name


def muon_matrices(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """The tensors Muon trains (as nanochat splits them: the matrices inside the blocks, attention and
    feed-forward, dense and experts; the router, norms, biases, embeddings and head keep AdamW):
    name -> (matrices, rows, cols), an expert stack (E, R, C) being E matrices."""
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.startswith("blk.") and len(shape) >= 2 and "ffn_gate_inp" not in name and trains(cfg)(name):
            out[name] = (int(np.prod(shape[:-2])), int(shape[-2]), int(shape[-1]))
    return out


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs a token (forward and backward), nanochat's estimate: 6 per weight of every matrix product
    (the block matrices, experts at n_expert_used / n_expert of theirs, and the output head, tied or not; not the
    embedding lookups) plus 12 L C T for attention's scores and mixing at context T = seq_len."""
    n = cfg.vocab_size * cfg.n_embd  # the output projection
    for name, shape in param_shapes(cfg).items():
        if name.startswith("blk.") and len(shape) >= 2:
            w = float(np.prod(shape))
            n += w * cfg.n_expert_used / cfg.n_expert if len(shape) == 3 else w
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


def num_params(cfg: ModelConfig) -> int:
    return int(sum(np.prod(s) for s in param_shapes(cfg).values()))
