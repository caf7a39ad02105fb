"""Hugging Face export: a folder `transformers` loads with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`, no code of ours needed.

    config.json              GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama), MixtralForCausalLM (llama + experts)
    model.safetensors        float32 weights under the Hugging Face names (written here with numpy)
    tokenizer.json           the byte-level BPE for the `tokenizers` library
    tokenizer_config.json    special tokens and the ChatML chat template (clgpt.text.chat.CHAT_TEMPLATE)
    generation_config.json   BOS, the end-of-generation ids, greedy by default

Weights. gpt2: transformers' GPT-2 keeps its linear layers as Conv1D, y = x @ W + b with W (in, out), the
transpose of our (out, in) matrices; q, k, v stay fused in c_attn, heads contiguous as ours. llama: RoPE.
clgpt rotates adjacent pairs (2i, 2i+1) of each head (llama.cpp's layout); transformers rotates the halves
(i, i + D/2) (`rotate_half`). Within each head of Q and K the rows are reordered so that row 2i goes to i and
row 2i+1 to D/2 + i: the inverse of the permutation llama.cpp's convert_hf_to_gguf.py applies on the way in.
Attention scores are dot products over a head, so reordering q's and k's channels alike changes none of them.
Mixture of experts: Mixtral's router (softmax, top-k, renormalised weights) is clgpt's; each expert is
w1 = gate, w3 = up, w2 = down, in the per-expert layout of Mixtral's published checkpoints.
Tied output: `tie_word_embeddings` and no lm_head tensor (safetensors holds no shared tensors).

Tokenizer. Ids 0..255 are the bytes, so the vocabulary maps each token's GPT-2 bytes-to-unicode spelling to
our id, not to GPT-2's byte order. The pre-tokenizer is our split regex, then the byte-level map without its
own regex; the specials are added tokens, matched before the BPE as llama.cpp matches them in a rendered
chat template. `add_bos_token` as in the GGUF: a plain `tokenizer(text)` starts with `<s>`.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from clgpt.atomic import atomic_path, write_text_atomic
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig, param_shapes
from clgpt.text.chat import CHAT_TEMPLATE
from clgpt.text.tokenizer import GPT2_SPLIT_PATTERN, SPECIAL_TOKENS, Tokenizer

HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


# ---- weights ------------------------------------------------------------------------------------


def rope_to_halves(w: np.ndarray, n_head: int) -> np.ndarray:
    """(n_head*D, C) Q or K rows in adjacent-pair order -> half-split order: row h*D + 2i + j goes to
    h*D + j*D/2 + i (j = 0, 1)."""
    rows, C = w.shape
    D = rows // n_head
    return np.ascontiguousarray(w.reshape(n_head, D // 2, 2, C).transpose(0, 2, 1, 3).reshape(rows, C))


def rope_to_pairs(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of rope_to_halves (what llama.cpp's converter does to a Hugging Face checkpoint)."""
    rows, C = w.shape
    D = rows // n_head
    return np.ascontiguousarray(w.reshape(n_head, 2, D // 2, C).transpose(0, 2, 1, 3).reshape(rows, C))


def hf_architecture(cfg: ModelConfig) -> str:
    if cfg.arch == "gpt2":
        return "GPT2LMHeadModel"
    return "MixtralForCausalLM" if cfg.n_expert else "LlamaForCausalLM"


def hf_state_dict(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 tensors under transformers' names for cfg.arch (see the module docstring)."""
    p = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    out: dict[str, np.ndarray] = {}
    if cfg.arch == "gpt2":
        out["transformer.wte.weight"] = p["token_embd.weight"]
        out["transformer.wpe.weight"] = p["position_embd.weight"]
        for i in range(cfg.n_layer):
            src, dst = f"blk.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
                out[dst + theirs + ".weight"] = p[src + ours + ".weight"]
                out[dst + theirs + ".bias"] = p[src + ours + ".bias"]
            for ours, theirs in (("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_up", "mlp.c_fc"),
                                 ("ffn_down", "mlp.c_proj")):
                out[dst + theirs + ".weight"] = np.ascontiguousarray(p[src + ours + ".weight"].T)  # Conv1D: (in, out)
                out[dst + theirs + ".bias"] = p[src + ours + ".bias"]
        out["transformer.ln_f.weight"] = p["output_norm.weight"]
        out["transformer.ln_f.bias"] = p["output_norm.bias"]
    else:
        out["model.embed_tokens.weight"] = p["token_embd.weight"]
        for i in range(cfg.n_layer):
            src, dst = f"blk.{i}.", f"model.layers.{i}."
            out[dst + "input_layernorm.weight"] = p[src + "attn_norm.weight"]
            out[dst + "self_attn.q_proj.weight"] = rope_to_halves(p[src + "attn_q.weight"], cfg.n_head)
            out[dst + "self_attn.k_proj.weight"] = rope_to_halves(p[src + "attn_k.weight"], cfg.kv_heads)
            out[dst + "self_attn.v_proj.weight"] = p[src + "attn_v.weight"]
            out[dst + "self_attn.o_proj.weight"] = p[src + "attn_output.weight"]
            out[dst + "post_attention_layernorm.weight"] = p[src + "ffn_norm.weight"]
            if cfg.n_expert:
                moe = dst + "block_sparse_moe."
                out[moe + "gate.weight"] = p[src + "ffn_gate_inp.weight"]
                for e in range(cfg.n_expert):
                    for ours, w in (("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")):
                        out[f"{moe}experts.{e}.{w}.weight"] = np.ascontiguousarray(p[src + ours + ".weight"][e])
            else:
                for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                    out[dst + "mlp." + theirs + ".weight"] = p[src + ours + ".weight"]
        out["model.norm.weight"] = p["output_norm.weight"]
    if not cfg.tied:
        out["lm_head.weight"] = p["output.weight"]
    return out


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header naming each tensor's
    dtype, shape and [begin, end) byte range of the data that follows, padded with spaces to 8 bytes."""
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype != np.float32:
            raise ValueError(f"{name}: only float32 tensors are written, got {t.dtype}")
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t, dtype="<f4").tobytes())


# ---- configs ------------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    """config.json for transformers' class of cfg.arch."""
    common = {"architectures": [hf_architecture(cfg)], "vocab_size": cfg.vocab_size, "bos_token_id": tok.bos_id,
              "eos_token_id": tok.im_end_id, "tie_word_embeddings": cfg.tied, "torch_dtype": "float32"}
    if cfg.arch == "gpt2":
        return {**common, "model_type": "gpt2", "n_positions": cfg.n_ctx, "n_embd": cfg.n_embd,
                "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.n_ff,
                "activation_function": "gelu_new",  # the tanh form clgpt trains with
                "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, "use_cache": True}
    out = {**common, "model_type": "mixtral" if cfg.n_expert else "llama", "hidden_size": cfg.n_embd,
           "intermediate_size": cfg.n_ff, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
           "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
           "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
           "attention_dropout": 0.0, "use_cache": True}
    if cfg.n_expert:
        out.update({"num_local_experts": cfg.n_expert, "num_experts_per_tok": cfg.n_expert_used,
                    "router_aux_loss_coef": cfg.moe_aux_loss, "output_router_logits": False,
                    "router_jitter_noise": 0.0, "sliding_window": None})
    else:
        out.update({"attention_bias": False, "mlp_bias": False})
    return out


def tokenizer_json(tok: Tokenizer) -> dict:
    """tokenizer.json (the `tokenizers` library's format) of our byte-level BPE."""
    n_normal = 256 + len(tok.merges)
    names = tok.gguf_tokens()
    added = [{"id": tok.bos_id + k, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for k, s in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": GPT2_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {  # BOS before a plain text, as tokenizer.ggml.add_bos_token
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": SPECIAL_TOKENS[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": SPECIAL_TOKENS[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {SPECIAL_TOKENS[0]: {"id": SPECIAL_TOKENS[0], "ids": [tok.bos_id],
                                                   "tokens": [SPECIAL_TOKENS[0]]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {names[i]: i for i in range(n_normal)},
                  "merges": [[names[a], names[b]] for a, b in tok.merges]},
    }


def tokenizer_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    bos, eos, im_start, im_end = SPECIAL_TOKENS
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": im_end, "pad_token": eos,
            "unk_token": None, "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.n_ctx, "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {str(tok.bos_id + k): {"content": s, "lstrip": False, "normalized": False,
                                                           "rstrip": False, "single_word": False, "special": True}
                                     for k, s in enumerate(SPECIAL_TOKENS)}}


def generation_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    """Stops at `<|im_end|>` (end of a turn) and `</s>` (end of a document): llama.cpp's end-of-generation set."""
    return {"bos_token_id": tok.bos_id, "eos_token_id": [tok.im_end_id, tok.eos_id], "pad_token_id": tok.eos_id,
            "do_sample": False, "max_length": cfg.n_ctx}


# ---- the folder ---------------------------------------------------------------------------------


def export_hf(out_dir: str | os.PathLike, cfg: ModelConfig, params: dict[str, np.ndarray], tok: Tokenizer,
              metadata: dict | None = None) -> list[str]:
    """Write HF_FILES into out_dir (each atomically); -> their paths."""
    out_dir = os.fspath(out_dir)
    cfg.validate()
    if tok.vocab_size != cfg.vocab_size:
        raise ClgptError(f"{out_dir}: the tokenizer has {tok.vocab_size} tokens but model.vocab_size is "
                         f"{cfg.vocab_size}; export the tokenizer the model was trained with")
    shapes = param_shapes(cfg)
    for k, shape in shapes.items():
        if k not in params or tuple(params[k].shape) != shape:
            raise ClgptError(f"{out_dir}: parameter {k} is missing or not of shape {shape}; the checkpoint does not "
                             "match its config")
        if not np.all(np.isfinite(params[k])):
            raise ClgptError(f"{out_dir}: parameter {k} holds NaN or inf; the model diverged, do not export it")
    try:
        os.makedirs(out_dir, exist_ok=True)
        paths = [os.path.join(out_dir, name) for name in HF_FILES]
        texts = (hf_config(cfg, tok), None, tokenizer_json(tok), tokenizer_config(cfg, tok), generation_config(cfg, tok))
        for path, obj in zip(paths, texts):
            if obj is None:
                meta = {"format": "pt", **{f"clgpt.{k}": v for k, v in sorted((metadata or {}).items())}}
                write_safetensors(path, hf_state_dict(cfg, params), meta)
            else:
                write_text_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
    except OSError as e:
        raise ClgptError(f"{out_dir}: cannot write the Hugging Face export ({e.strerror or e})") from None
    return paths
