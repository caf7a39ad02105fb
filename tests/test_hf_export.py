"""The Hugging Face export against transformers (CPU torch): it loads as GPT2LMHeadModel, LlamaForCausalLM or
MixtralForCausalLM; its logits on held-out text equal clgpt's engine within 1e-4; greedy generation gives
the same tokens; the tokenizer gives our ids; apply_chat_template renders our ChatML; the safetensors file
reads back with the safetensors library; and `snakemake hf` builds the folder from the final checkpoint.

Measured on these tiny trained models (logits up to ~12): transformers' float32 logits differ from the engine's
by at most 7.2e-6 (gpt2 3.8e-6, llama 7.2e-6, MoE 5.7e-6). Without the RoPE reordering of Q and K the llama
logits differ by 10.8.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from clgpt.errors import ClgptError
from clgpt.inference.generate import Generator
from clgpt.io import hf_export
from clgpt.io.hf_export import HF_FILES, export_hf, hf_state_dict, rope_to_halves, rope_to_pairs
from clgpt.model import ModelConfig, init_params
from clgpt.models.factory import make_engine
from clgpt.text.chat import CHAT_TEMPLATE, encode_chat, encode_prompt
from clgpt.text.tokenizer import Tokenizer
from clgpt.training.train import pad_dialogs
from clgpt.device.knobs import Knobs

TEXT = ["The cat sat on the mat.", "The dog sat on the log.", "Birds fly over the sea.",
        "Привет, мир! Кошка сидит на ковре.", "One, two, three: numbers 123 and 4567."]
DIALOGS = [("Where is the cat?", "The cat sat on the mat."), ("What flies?", "Birds fly over the sea.")]
HELDOUT = ["The bird sat on the sea, the dog on the mat.", "Кошка летит над морем: 89 птиц!", "zebra 🙂 quantum?!\n\n  x"]
N_CTX = 256  # gpt2 exports need a multiple of 256 (clgpt.io.gguf); the HF export does not, but keep one shape
LOGIT_TOL = 1e-4
SHAPES = {
    "gpt2": dict(arch="gpt2"),
    "gpt2_untied": dict(arch="gpt2", tied=False),
    "llama_gqa": dict(arch="llama", n_head=4, n_head_kv=2),
    "moe": dict(arch="llama", n_head=4, n_head_kv=1, n_expert=4, n_expert_used=2, tied=False),
}
CLASSES = {"gpt2": "GPT2LMHeadModel", "gpt2_untied": "GPT2LMHeadModel", "llama_gqa": "LlamaForCausalLM",
           "moe": "MixtralForCausalLM"}


def train_tiny(tok, shape):
    """A 2-layer model memorising TEXT and DIALOGS (40 AdamW steps on the engine): trained logits, not
    random ones, are what the export must carry."""
    cfg = ModelConfig(**{"vocab_size": tok.vocab_size, "n_ctx": N_CTX, "n_embd": 32, "n_head": 2, "n_layer": 2,
                         "n_ff": 64, **shape})
    rows = [([tok.bos_id, *tok.encode(s), tok.eos_id], 0) for s in TEXT]
    rows += [encode_chat(tok, [{"role": "user", "content": u}, {"role": "assistant", "content": a}]) for u, a in DIALOGS]
    tokens, targets, mask, _ = pad_dialogs(rows, 64)
    eng = make_engine(cfg, init_params(cfg, 0), batch_size=tokens.shape[0], seq_len=tokens.shape[1], knobs=Knobs())
    for _ in range(40):
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        eng.step(1e-2, weight_decay=0.0)
    assert loss < 2.0, f"the tiny model did not learn (loss {loss:.3f})"
    return cfg, eng.get_params()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT + [f"{u} {a}" for u, a in DIALOGS] + ["user\nassistant\nsystem\n"] * 3, 330)


@pytest.fixture(scope="module")
def models(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, shape in SHAPES.items():
        cfg, params = train_tiny(tok, shape)
        export_hf(d / kind, cfg, params, tok)
        out[kind] = (cfg, params, d / kind)
    return out


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def heldout_ids(tok) -> list[list[int]]:
    return [[tok.bos_id, *tok.encode(s)] for s in HELDOUT] + [encode_prompt(tok, u) for u, _ in DIALOGS]


def test_rope_reordering_inverts_llama_cpps_converter():
    """convert_hf_to_gguf.py's permute (Hugging Face halves -> llama.cpp pairs), as written there."""

    def permute(weights, n_head):
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
            weights.shape)

    w = np.random.default_rng(0).normal(size=(4 * 8, 5)).astype(np.float32)
    assert np.array_equal(permute(rope_to_halves(w, 4), 4), w)
    assert np.array_equal(rope_to_pairs(w, 4), permute(w, 4))
    assert not np.array_equal(rope_to_halves(w, 4), w)
    # head 1's pair (2, 3) = channel pair i = 1 becomes rows (1, 1 + D/2) of that head
    assert np.array_equal(rope_to_halves(w, 4)[[8 + 1, 8 + 4 + 1]], w[[8 + 2, 8 + 3]])


def test_folder_holds_the_five_files(models, tok):
    cfg, _, path = models["llama_gqa"]
    assert sorted(p.name for p in path.iterdir()) == sorted(HF_FILES)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.im_end_id, tok.eos_id] and gen["bos_token_id"] == tok.bos_id
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


@pytest.mark.parametrize("kind", list(SHAPES))
def test_safetensors_read_back_with_the_safetensors_library(models, kind):
    cfg, params, path = models[kind]
    want = hf_state_dict(cfg, params)
    got = safetensors.numpy.load_file(str(path / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == np.float32 and np.array_equal(got[k], want[k]), k
    assert ("lm_head.weight" in got) == (not cfg.tied)


@pytest.mark.parametrize("kind", list(SHAPES))
def test_transformers_logits_equal_clgpt(models, tok, kind):
    cfg, params, path = models[kind]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == CLASSES[kind]
    eng = make_engine(cfg, params, batch_size=1, seq_len=64, knobs=Knobs())
    for ids in heldout_ids(tok):
        ours = eng.forward(np.array([ids], np.int32))[0].astype(np.float64)
        theirs = hf_logits(model, ids)
        diff = np.abs(theirs - ours).max()
        assert diff <= LOGIT_TOL, f"{kind}: transformers vs clgpt logits differ by {diff:.3g} on {ids}"
        assert np.abs(ours).max() > 1.0  # trained logits, not a near-zero model


def test_llama_needs_the_rope_reordering(models, tok, tmp_path, monkeypatch):
    cfg, params, _ = models["llama_gqa"]
    monkeypatch.setattr(hf_export, "rope_to_halves", lambda w, n_head: w)
    export_hf(tmp_path, cfg, params, tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = heldout_ids(tok)[0]
    ours = make_engine(cfg, params, batch_size=1, seq_len=64, knobs=Knobs()).forward(np.array([ids], np.int32))[0]
    assert np.abs(hf_logits(model, ids) - ours).max() > 0.1


@pytest.mark.parametrize("kind", ["gpt2", "moe"])
def test_greedy_generation_gives_the_same_tokens(models, tok, kind):
    """transformers' generate with the exported generation_config (greedy, stops at <|im_end|> or </s>)
    against clgpt's Generator with the same stop ids."""
    cfg, params, path = models[kind]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    gen = Generator(cfg, params, knobs=Knobs())
    for ids in [encode_prompt(tok, u) for u, _ in DIALOGS] + [[tok.bos_id, *tok.encode("The cat")]]:
        ours = [t for t, _ in gen.generate(ids, 16, greedy=True, stop_ids=(tok.im_end_id, tok.eos_id))]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16)[0, len(ids):].tolist()
        theirs = [t for t in out if t != tok.eos_id]  # generate pads finished rows with pad_token_id (</s>)
        if theirs and theirs[-1] == tok.im_end_id:
            theirs = theirs[:-1]
        assert theirs == ours, (tok.decode(theirs), tok.decode(ours))
    reply = [t for t, _ in gen.generate(encode_prompt(tok, DIALOGS[0][0]), 16, greedy=True, stop_ids=(tok.im_end_id,))]
    assert tok.decode(reply) == DIALOGS[0][1]  # the memorised reply: the comparison above covers a real answer


def test_tokenizer_gives_our_ids(models, tok):
    t = transformers.AutoTokenizer.from_pretrained(models["gpt2"][2])
    strings = HELDOUT + TEXT + ["", " ", "\n", "\r\n", "  leading", "trailing  ", "tabs\tand\u00a0nbsp", "'s 're 'LL",
                                "中文 and 日本語", "👩‍💻 emoji", "\x00\x1b control", "e\u0301 combining", "<user>"]
    for s in strings:
        ids = tok.encode(s)
        assert t(s, add_special_tokens=False).input_ids == ids, repr(s)
        assert t(s).input_ids == [tok.bos_id, *ids], repr(s)  # add_bos_token, as the GGUF's
        assert t.decode(ids) == s, repr(s)
    assert t.convert_tokens_to_ids(["<s>", "</s>", "<|im_start|>", "<|im_end|>"]) == [
        tok.bos_id, tok.eos_id, tok.im_start_id, tok.im_end_id]


def test_apply_chat_template_renders_our_chatml(models, tok):
    t = transformers.AutoTokenizer.from_pretrained(models["llama_gqa"][2])
    conversations = [
        [{"role": "user", "content": "Where is the cat?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What flies?"}],
        [{"role": "user", "content": "Where is the cat?"}, {"role": "assistant", "content": "The cat sat on the mat."},
         {"role": "user", "content": "What flies?"}],
    ]
    for messages in conversations:
        text = t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = "<s>" + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        assert text == expected + "<|im_start|>assistant\n"
        ids = t.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert list(ids) == encode_prompt(tok, messages)


def test_export_refuses_bad_input(tok, tmp_path):
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=N_CTX, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    params = init_params(cfg, 0)
    with pytest.raises(ClgptError, match="tokenizer has"):
        export_hf(tmp_path / "a", ModelConfig(**{**json.loads(cfg.to_json()), "vocab_size": tok.vocab_size + 1}),
                  params, tok)
    params["blk.0.ffn_up.weight"][0, 0] = np.nan
    with pytest.raises(ClgptError, match="NaN"):
        export_hf(tmp_path / "b", cfg, params, tok)
    assert not (tmp_path / "b").exists()


def test_snakemake_hf_target_exports_the_final_model(tmp_path):
    """`snakemake hf` on the tiny workflow: the tuned checkpoint as hf/, without the evaluate and export
    stages; transformers gives the engine's logits on held-out text and our tokenizer's ids."""
    from test_pipeline import make_workdir, snakemake

    from clgpt.io.checkpoint import load_checkpoint

    path = make_workdir(tmp_path / "wf")
    r = snakemake(path, "hf")
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(p.name for p in (path / "hf").iterdir()) == sorted(HF_FILES)
    assert not (path / "model.gguf").exists() and not (path / "results/eval").exists()
    assert "Nothing to be done" in (lambda r: r.stdout + r.stderr)(snakemake(path, "-n", "hf"))
    ck = load_checkpoint(str(path / "results/tune/model.ckpt"))
    tok = Tokenizer.load(path / "results/tokenizer/tokenizer.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(path / "hf")
    t = transformers.AutoTokenizer.from_pretrained(path / "hf")
    eng = make_engine(ck["cfg"], ck["params"], batch_size=1, seq_len=64, knobs=Knobs())
    for line in (path / "data/heldout/pretrain.txt").read_text(encoding="utf-8").splitlines()[:3]:
        ids = t(line).input_ids[:64]
        assert ids[1:] == tok.encode(line)[:63]
        ours = eng.forward(np.array([ids], np.int32))[0]
        assert np.abs(hf_logits(model, ids) - ours).max() <= LOGIT_TOL
