"""The capabilities record (clgpt/device/capabilities.py): the op forms and GEMM backend each launch row gives, and
the kernels Ops builds agreeing with them, on this device for every row (CPU, GPU, NVIDIA, emulated tensor
cores)."""

from __future__ import annotations

import dataclasses

import pytest

from clgpt.models.factory import make_engine
from clgpt.device.knobs import OFF, Knobs
from clgpt.model import ModelConfig, init_params
from clgpt.device.capabilities import Capabilities, capabilities

EMULATED = Knobs(launch="nvidia", mma_emulate=True, mma=dict(BM=32, BN=32, WM=2, WN=2),
                 mma_small=dict(BM=32, BN=16, WM=1, WN=1), bf16=dict(BM=32, BN=32, WM=2, WN=2, STAGES=3),
                 bf16_small=dict(BM=32, BN=32, WM=1, WN=1, STAGES=2))
ROWS = {"cpu": Knobs(launch="cpu"), "gpu": Knobs(launch="gpu"), "nvidia": Knobs(launch="nvidia"),
        "nvidia-emulated": EMULATED}

GPU_FORMS = ("layernorm_rows", "rope_per_pair", "swiglu_per_element", "grad_norm_groups", "moe_route_group",
             "moe_weight_backward_groups", "split_k")
CPU_FORMS = ("row_groups_of_one", "embedding_rows", "adamw_v8", "transpose_v8", "rope_vec", "grad_norm_v8", "pad_ld",
             "xent_fused", "bias_v8", "attention_u4", "attention_rb")
# field -> a kernel Ops builds (under that name in ops.k) exactly where the record picks the form
FORM_KERNEL = {"layernorm_rows": "layernorm_forward_rows", "rope_per_pair": "rope_forward_el",
               "swiglu_per_element": "swiglu_rows_forward_v4", "grad_norm_groups": "grad_norm_partial_wg",
               "moe_route_group": "moe_route_packed_wg", "moe_weight_backward_groups": "moe_weight_backward_wg",
               "embedding_rows": "embedding_forward_rows", "adamw_v8": "adamw_v8", "transpose_v8": "transpose_v8",
               "pad_ld": "copy_ld_v8", "xent_fused": "xent_fused", "bias_v8": "bias_backward_v8",
               "attention_rb": "attention_rows_rb"}
# fields whose form replaces the kernel of the same name: -> (name in ops.k, its function when picked)
FORM_FUNCTION = {"grad_norm_v8": ("grad_norm_partial", "grad_norm_partial_v8"),
                 "attention_u4": ("attention_forward", "attention_forward_u4")}

# C = 128 and D = 32 allow every shape-bound form (LayerNorm and RMSNorm rows: C % 128; register-blocked
# attention: D % 16); Llama with experts and grouped queries builds RoPE, SwiGLU and MoE's forms
GPT2 = ModelConfig(vocab_size=64, n_ctx=16, n_embd=128, n_head=4, n_layer=1, n_ff=64)
LLAMA = ModelConfig(arch="llama", vocab_size=64, n_ctx=16, n_embd=128, n_head=4, n_head_kv=2, n_layer=1, n_ff=64,
                    n_expert=4, n_expert_used=2)


@pytest.mark.parametrize("row", ROWS)
def test_each_launch_row_gives_its_forms(dev, row):
    caps = capabilities(dev.device, ROWS[row])
    gpu = row != "cpu"
    assert caps.group_rows == (128 if gpu else 0)
    for field in GPU_FORMS:
        assert getattr(caps, field) is gpu, field
    for field in CPU_FORMS:
        assert getattr(caps, field) is not gpu, field
    assert caps.attention_gemm_min_t == (128 if gpu else None)
    assert caps.preset
    emulated = row == "nvidia-emulated"
    assert caps.tensor_cores is emulated and not caps.wgmma and not caps.colsum_copies  # no sm_90a here
    assert [caps.gemm_backend(r) for r in (0, 1, 2)] == (["portable", "bf16", "mma"] if emulated else ["portable"] * 3)
    assert "BF16_CVT" not in caps.bf16_options  # PTX's conversion: NVIDIA's builds alone (precision.cl)


def test_the_bf16_gemm_turned_off_leaves_bf16_on_mma(dev):
    caps = capabilities(dev.device, dataclasses.replace(EMULATED, bf16=OFF))
    assert not caps.bf16_gemm and caps.gemm_backend(1) == "mma"


def test_a_record_is_made_once_per_device_and_knobs(dev):
    assert capabilities(dev.device, Knobs(launch="gpu")) is capabilities(dev.device, Knobs(launch="gpu"))
    assert capabilities(dev.device, Knobs(launch="gpu")) is not capabilities(dev.device, Knobs(launch="cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities(dev.device, Knobs()).split_k = True


@pytest.mark.parametrize("row", ROWS)
def test_the_kernels_built_are_the_forms_the_record_picks(dev, row):
    """Every form the record picks has its kernel in ops.k, and no form it leaves out does; the GEMM backend's
    tiles and copies are there exactly when it picks that backend."""
    kn = ROWS[row]
    caps = capabilities(dev.device, kn)
    assert set(FORM_KERNEL) | set(FORM_FUNCTION) | {"row_groups_of_one", "rope_vec", "split_k"} >= set(
        GPU_FORMS + CPU_FORMS)
    built = {}
    for cfg in (GPT2, LLAMA):
        precision = "bf16" if caps.tensor_cores else "fp32"
        ops = make_engine(cfg, init_params(cfg, 0), batch_size=1, seq_len=16, device=dev, precision=precision,
                          knobs=kn).ops
        assert ops.caps is caps
        assert ops.gemm == caps.gemm_backend(ops.round)
        assert (ops.mma is not None, ops.bf16 is not None, "to_bf16" in ops.k) == ((ops.gemm != "portable",) +
                                                                                   (ops.gemm == "bf16",) * 2)
        built.update(ops.k)
    for field, name in FORM_KERNEL.items():
        assert (name in built) is getattr(caps, field), f"{row}: {field} but {name} {'not ' * (name not in built)}built"
    assert ("rmsnorm_forward_rows" in built) is caps.layernorm_rows, f"{row}: RMSNorm's rows follow LayerNorm's"
    for field, (name, function) in FORM_FUNCTION.items():
        assert (built[name].function_name == function) is getattr(caps, field), f"{row}: {field}"
