"""`make_engine`: the engine for a model's architecture.

The one module that knows every architecture: it imports each engine, and each engine imports only the base
(clgpt.models.base), so no import runs from the base back to an architecture.
"""

from __future__ import annotations

from clgpt.device.opencl import Device
from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig
from clgpt.models.base import EngineBase
from clgpt.models.gpt2 import GPT2Engine
from clgpt.models.llama import LlamaEngine


def make_engine(cfg: ModelConfig, params: dict, batch_size: int, seq_len: int, device: Device | str | None = None,
                dropout: float = 0.0, precision: str = "fp32", optimizer: bool = True, *,
                knobs: Knobs, attention: str = "auto", muon: bool = False, label_smoothing: float = 0.0) -> EngineBase:
    """The engine for cfg.arch (GPT2Engine or LlamaEngine, same interface); device: a Device, a spec string
    or None (clgpt.device.opencl.resolve_device); dropout: the probability on embeddings, attention probabilities
    and residual branches, active in forward calls with targets and a dropout_seed; precision: the matmuls'
    operands, fp32 | tf32 | bf16 | auto (clgpt/device/precision.py); optimizer=False: no AdamW moments (a frozen
    base under LoRA adapters, clgpt.models.lora); knobs: the clgpt.device.knobs switches, read once at the caller's edge (clgpt.device.knobs.read: the
    environment's); attention: auto | flash | batched, where bf16 attention may run as flash attention's fused
    kernels (clgpt/ops/attention.py); muon: the block matrices take Muon (step's muon
    settings), clgpt.model.muon_matrices; label_smoothing: eps in [0, 1) of the training loss's target
    (1 - eps) onehot + eps / V, in forward calls with targets unless they pass smoothed=False."""
    cls = LlamaEngine if cfg.arch == "llama" else GPT2Engine  # another arch: the engine's cfg.validate() names it
    return cls(cfg, params, batch_size=batch_size, seq_len=seq_len, device=device, dropout=dropout,
               precision=precision, optimizer=optimizer, knobs=knobs, attention=attention, muon=muon,
               label_smoothing=label_smoothing)
