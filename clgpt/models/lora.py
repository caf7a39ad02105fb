"""LoRA: low-rank adapters trained on a frozen base (Hu et al. 2021), and their GGUF for llama.cpp's `--lora`.

A target matrix W (out, in) of the base becomes W0 + s * B @ A with A (r, in), B (out, r), s = alpha / r;
W0 stays as the base had it, B starts at zero (the tuned model starts as the base), A as PEFT draws it
(uniform within +-1/sqrt(in)). Only A and B train: their gradients, clipping and AdamW moments live in a
parameter store of their own; the base's store is made without moments.

The engine runs the merged weights: before a forward that follows an update, each target's W is rewritten on
the device as W0 + s * B @ A (one product with K = r, W0 as its residual), so every architecture and device
path of the engine runs unchanged. The backward is the engine's: it leaves dL/dW in the base's gradient
store, and since W is linear in the adapters, dL/dA = s * B.T @ dL/dW and dL/dB = s * dL/dW @ A.T (two
products per target, once per optimizer step, on the gradient summed over the micro-batches). This costs
the weight gradients of the whole base, as full tuning does; what it saves is the optimizer state (two
floats per base weight) and the size of what ships.

Export: the merged weights are the tuned model (model.gguf); the adapter GGUF holds, for each target,
`<base tensor name>.lora_a` (numpy (r, in), ggml ne [in, r]) and `.lora_b` (numpy (out, r), ggml ne
[r, out]), `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`: llama.cpp
(src/llama-adapter.cpp) checks base ne[0] == a.ne[0], base ne[1] == b.ne[1], a.ne[1] == b.ne[0], and adds
(alpha / r) * B @ (A @ x) to each target's product.

Checkpoints: the tune stage's params are the merged weights (what evaluate and export read); the adapters ride
in the optimizer state under "lora", with the settings, so a resume restores them and export finds them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clgpt.errors import ClgptError
from clgpt.model import ModelConfig, param_shapes

# The block matrices an adapter may target, by architecture (per-layer GGUF names without blk.N. / .weight);
# the embeddings, the output head and the stacked expert tensors are left to full tuning.
TARGETS = {
    "llama": ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
    "gpt2": ("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
}
A_SUFFIX, B_SUFFIX = ".lora_a", ".lora_b"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def _defaults() -> dict:
    from clgpt.config import load_schema

    props = load_schema()["properties"]["tune"]["properties"]["lora"]["properties"]
    return {k: v.get("default") for k, v in props.items()}


def lora_spec(settings: dict | None, cfg: ModelConfig, where: str = "tune.lora") -> LoraSpec | None:
    """The checked adapter settings ({rank, alpha, targets}; None or absent: full tuning) for model `cfg`."""
    if settings is None:
        return None
    s = {**_defaults(), **{k: v for k, v in settings.items() if v is not None}}
    allowed = [t for t in TARGETS[cfg.arch] if not (cfg.n_expert and t.startswith("ffn_"))]
    targets = tuple(s["targets"] or allowed)
    for t in targets:
        if t not in allowed:
            raise ClgptError(f"{where}.targets: {t!r} is not a matrix of this {cfg.arch} model's blocks; "
                             f"use some of {', '.join(allowed)}")
    if len(set(targets)) != len(targets):
        raise ClgptError(f"{where}.targets: {list(targets)} names a matrix twice; list each once")
    rank = int(s["rank"])
    narrowest = min(min(shape) for shape in target_shapes(cfg, targets).values())
    if not 1 <= rank <= narrowest:
        raise ClgptError(f"{where}.rank: {rank} must lie in 1..{narrowest} (the narrowest target's side); lower it")
    return LoraSpec(rank, float(s["alpha"]), targets)


def target_shapes(cfg: ModelConfig, targets) -> dict[str, tuple[int, int]]:
    """{base tensor name: (out, in)} of every targeted matrix, layer by layer."""
    shapes = param_shapes(cfg)
    return {f"blk.{i}.{t}.weight": shapes[f"blk.{i}.{t}.weight"] for i in range(cfg.n_layer) for t in targets}


def adapter_shapes(cfg: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """{name: shape} of the adapters: A (r, in) and B (out, r) per target, named as llama.cpp reads them."""
    out = {}
    for name, (o, i) in target_shapes(cfg, spec.targets).items():
        out[name + A_SUFFIX], out[name + B_SUFFIX] = (spec.rank, i), (o, spec.rank)
    return out


def init_adapters(cfg: ModelConfig, spec: LoraSpec, seed: int) -> dict[str, np.ndarray]:
    """A uniform in +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5))), B zero: W0 + s*B@A starts at W0."""
    rng = np.random.default_rng([seed, 0x10AA])
    out = {}
    for name, shape in adapter_shapes(cfg, spec).items():
        if name.endswith(A_SUFFIX):
            bound = 1.0 / np.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


def merge(params: dict, adapters: dict, spec: LoraSpec) -> dict[str, np.ndarray]:
    """The base with every adapter added, W0 + s * B @ A, summed in float64 and rounded to float32 (host side)."""
    out = dict(params)
    for name in {n[: -len(A_SUFFIX)] for n in adapters if n.endswith(A_SUFFIX)}:
        a, b = adapters[name + A_SUFFIX].astype(np.float64), adapters[name + B_SUFFIX].astype(np.float64)
        out[name] = (params[name].astype(np.float64) + spec.scale * (b @ a)).astype(np.float32)
    return out


def checkpoint_lora(ckpt: dict) -> tuple[LoraSpec, dict[str, np.ndarray]] | None:
    """(spec, adapters) of a LoRA-tuned checkpoint, None for any other."""
    lora = (ckpt.get("opt_state") or {}).get("lora")
    if not lora:
        return None
    spec = LoraSpec(int(lora["rank"]), float(lora["alpha"]), tuple(lora["targets"]))
    return spec, {k: np.asarray(v, np.float32) for k, v in lora["adapters"].items()}


def export_adapter(path: str | os.PathLike, cfg: ModelConfig, spec: LoraSpec, adapters: dict[str, np.ndarray],
                   name: str = "clgpt") -> None:
    """Write the adapters as a llama.cpp LoRA GGUF (F32) at `path`, atomically; `llama-cli -m BASE.gguf
    --lora path` (or llama-cpp-python's Llama(lora_path=...)) adds them to the base."""
    from gguf import GGUFValueType, GGUFWriter

    path = os.fspath(path)
    want = adapter_shapes(cfg, spec)
    for k, shape in want.items():
        a = adapters.get(k)
        if a is None or tuple(a.shape) != shape:
            raise ClgptError(f"{path}: adapter {k} is {None if a is None else tuple(a.shape)}, expected {shape}")
        if not np.isfinite(a).all():
            raise ClgptError(f"{path}: adapter {k} holds NaN or inf; the tune diverged, do not export it")
    w = GGUFWriter(None, cfg.arch)
    w.add_name(name)
    w.add_type("adapter")
    w.add_key_value("adapter.type", "lora", GGUFValueType.STRING)
    w.add_key_value("adapter.lora.alpha", float(spec.alpha), GGUFValueType.FLOAT32)
    w.add_file_type(0)  # ALL_F32
    for k in want:
        w.add_tensor(k, np.ascontiguousarray(adapters[k], np.float32))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        w.write_header_to_file(path=Path(tmp))
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
