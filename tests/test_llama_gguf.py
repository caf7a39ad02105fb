"""Exported `llama` GGUFs (dense with grouped-query heads, and mixture of experts) against llama.cpp
through llama-cpp-python: it loads them, its logits match our forward pass, greedy completions are
identical, and the context is what the model was trained for.

Tolerances, measured on tiny models. llama.cpp keeps its KV cache in fp16 by default: logits differ from
the float64 reference by up to ~6e-4 of max|logit| (random weights; less once trained), so the test allows
F16_KV_TOL = 2e-3 of it. With an f32 KV cache (type_k = type_v = F32) the difference is ~5e-7: RoPE
(adjacent pairs), RMSNorm, SwiGLU, GQA and the router (softmax, top-k, renormalised weights) agree to
float32 rounding, and the test allows F32_KV_TOL = 1e-5.

Context: a llama model has no position table. `llama.context_length` is the n_ctx it was trained for
(here 64, not a multiple of 256); llama.cpp may allocate a longer context (its default pads to 256) and
keeps generating past the trained length; our Generator stops at n_ctx.
"""

from __future__ import annotations

import llama_cpp  # noqa: F401  (fails collection loudly when the test dependency is missing)
import numpy as np
import pytest

from clgpt.inference.generate import Generator
from clgpt.io.gguf import export_gguf, read_gguf
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference_llama as ref
from clgpt.models.llama import LlamaEngine
from clgpt.text.chat import encode_dialog, encode_prompt
from clgpt.text.tokenizer import Tokenizer
from clgpt.training.train import pad_dialogs
from clgpt.device.knobs import Knobs

PRETRAIN = [
    "The cat sat on the mat.",
    "The dog sat on the log.",
    "Birds fly over the sea.",
    "Привет, мир! Кошка сидит на ковре.",
    "One, two, three: numbers 123 and 4567.",
]
DIALOGS = [("Where is the cat?", "The cat sat on the mat."), ("What flies?", "Birds fly over the sea.")]
PROMPTS = ["The cat", "Birds", "Привет", "One, two", "zebra 🙂 quantum?!"]
N_CTX = 64
F16_KV_TOL = 2e-3  # of max|logit|: llama.cpp's default fp16 KV cache
F32_KV_TOL = 1e-5  # of max|logit|: with an f32 KV cache
GGML_F32 = 0
SHAPES = {
    "dense_gqa": dict(n_head=4, n_head_kv=2),
    "moe": dict(n_head=4, n_head_kv=1, n_expert=4, n_expert_used=2, tied=False),
}


def train_tiny(tok, shape):
    """A 2-layer llama memorising the lines and dialogs above (60 AdamW steps on the engine)."""
    cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, n_ctx=N_CTX, n_embd=32, n_layer=2, n_ff=64,
                      **{"tied": True, **shape})
    rows = [([tok.bos_id, *tok.encode(s), tok.eos_id], 0) for s in PRETRAIN]  # text: every target counts
    rows += [encode_dialog(tok, u, a) for u, a in DIALOGS]  # dialogs: the reply's targets count
    tokens, targets, mask, _ = pad_dialogs(rows, N_CTX)
    eng = LlamaEngine(cfg, init_params(cfg, 0), batch_size=tokens.shape[0], seq_len=tokens.shape[1], knobs=Knobs())
    for _ in range(60):
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        eng.step(1e-2, weight_decay=0.0)
    assert loss < 1.0, f"the tiny model did not learn (loss {loss:.3f})"
    return cfg, eng.get_params()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tok = Tokenizer.train(PRETRAIN + [f"{u} {a}" for u, a in DIALOGS], 320)
    d = tmp_path_factory.mktemp("llama_arch")
    out = {}
    for kind, shape in SHAPES.items():
        cfg, params = train_tiny(tok, shape)
        path = str(d / f"{kind}.gguf")
        export_gguf(path, cfg, params, tok, name=f"clgpt-{kind}")
        out[kind] = (cfg, params, path)
    return tok, out


def load(path, n_ctx=N_CTX, f32_kv=False):
    kw = dict(type_k=GGML_F32, type_v=GGML_F32) if f32_kv else {}
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, logits_all=True, verbose=False, seed=0, **kw)


def llama_logits(llm, ids) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def prompt_ids(tok):
    return [[tok.bos_id, *tok.encode(p)] for p in PROMPTS] + [encode_prompt(tok, u) for u, _ in DIALOGS]


@pytest.mark.parametrize("kind", list(SHAPES))
def test_gguf_keys_and_read_back(models, kind):
    tok, out = models
    cfg, params, path = out[kind]
    cfg2, params2, _, kv = read_gguf(path)
    assert cfg2 == cfg
    assert all(np.array_equal(params[k], params2[k]) for k in params)
    assert kv["general.architecture"] == "llama" and kv["llama.context_length"] == N_CTX
    assert kv["llama.rope.dimension_count"] == cfg.head_dim and kv["llama.attention.head_count_kv"] == cfg.kv_heads
    if cfg.n_expert:
        assert (kv["llama.expert_count"], kv["llama.expert_used_count"]) == (4, 2)
        assert params2["blk.1.ffn_gate_exps.weight"].shape == (4, 64, 32)
        assert "blk.0.ffn_gate_inp.weight" in params2 and "blk.0.ffn_up.weight" not in params2
    else:
        assert "llama.expert_count" not in kv


@pytest.mark.parametrize("kind", list(SHAPES))
def test_logits_match_llama_cpp(models, kind):
    tok, out = models
    cfg, params, path = out[kind]
    gen = Generator(*read_gguf(path)[:2], knobs=Knobs())
    assert isinstance(gen.engine, LlamaEngine)
    llms = {"f16_kv": load(path), "f32_kv": load(path, f32_kv=True)}
    for ids in prompt_ids(tok):
        want = ref.llama_logits(params, cfg, np.array([ids]))[0]
        ours = gen.engine.forward(np.array([ids], np.int32))[0].astype(np.float64)
        scale = np.abs(want).max()
        assert np.abs(ours - want).max() <= 1e-5 * scale, f"engine vs reference: {np.abs(ours - want).max():.3g}"
        for name, tol in (("f16_kv", F16_KV_TOL), ("f32_kv", F32_KV_TOL)):
            diff = np.abs(llama_logits(llms[name], ids) - want).max()
            assert diff <= tol * scale, f"{name} llama.cpp vs reference on {ids}: {diff:.3g} of scale {scale:.3g}"


@pytest.mark.parametrize("kind", list(SHAPES))
def test_greedy_completions_identical(models, kind):
    tok, out = models
    _, _, path = out[kind]
    gen, llm = Generator(*read_gguf(path)[:2], knobs=Knobs()), load(path)
    for ids in prompt_ids(tok):
        ours = [t for t, _ in gen.generate(ids, max_tokens=20, greedy=True)]
        theirs = []
        for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(int(t))
            if len(theirs) == len(ours):
                break
        assert ours == theirs, f"prompt {tok.decode(ids)!r}: ours {tok.decode(ours)!r}, llama.cpp {tok.decode(theirs)!r}"
    for u, a in DIALOGS:  # the trained answers, through the GGUF's chat template
        r = llm.create_chat_completion(messages=[{"role": "user", "content": u}], temperature=0.0,
                                       repeat_penalty=1.0, max_tokens=40, seed=0)
        ours = gen.generate(encode_prompt(tok, u), max_tokens=40, greedy=True, stop_ids=[tok.im_end_id])
        assert r["choices"][0]["message"]["content"] == tok.decode([t for t, _ in ours])


def test_context_beyond_training_length(models):
    """llama.context_length is the trained 64; llama.cpp's default context (n_ctx=0) pads that up to 256
    (warning "n_ctx_seq (256) > n_ctx_train (64)") and, with no position table to run past, generates to
    the end of it without failing. Past 64 positions the model is extrapolating."""
    tok, out = models
    path = out["moe"][2]
    assert read_gguf(path)[3]["llama.context_length"] == N_CTX
    llm = llama_cpp.Llama(model_path=path, n_ctx=0, verbose=False, seed=0)  # logits_all would size by 64
    assert llm.n_ctx() == 256
    ids = [tok.bos_id, *tok.encode("The cat")]
    got = llm.create_completion(ids, max_tokens=100000, temperature=0.0, logit_bias={e: float("-inf") for e in (tok.eos_id, tok.im_end_id)})
    assert got["usage"]["total_tokens"] == llm.n_ctx()
