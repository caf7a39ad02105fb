"""The exported GGUF against an outside implementation: llama.cpp through llama-cpp-python.

A tiny model is trained for a few seconds on the OpenCL engine (so its logits are peaked and it
answers the dialogs with `</s>`), exported as f32 and q8_0, and loaded by llama.cpp. Checked: the
tokenizer, the logits (against our engine and the float64 reference), greedy completions, the chat
template with BOS and `</s>`, and a chat forced past `</s>` to the end of the context.

Tolerances. f32: llama.cpp evaluates GELU through an fp16 table and keeps the KV cache in fp16, so its
logits differ from ours by ~1.5e-4 (trained) to ~5e-4 (random weights) of the logit scale; the test
allows 1e-3 of max|logit|. q8_0: llama.cpp also quantizes the activations to 8 bits inside each matmul
(q8_0 x q8_0 dot products), which our float32 engine on the dequantized weights does not (measured up
to ~8e-3 of the logit scale); the test allows 3e-2 of max|logit| and relies on the greedy completions
being identical.

llama_cpp is a test dependency (pyproject [test]); when it is missing these tests fail, not skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import llama_cpp  # (fails collection loudly when the test dependency is missing)
import numpy as np
import pytest

from clgpt.inference.generate import Generator, eog_ids
from clgpt.io.gguf import export_gguf, read_gguf
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference
from clgpt.models.gpt2 import GPT2Engine as Engine
from clgpt.text.chat import encode_dialog, encode_prompt
from clgpt.text.tokenizer import Tokenizer
from clgpt.training.train import pad_dialogs
from clgpt.device.knobs import Knobs

PRETRAIN = [
    "The cat sat on the mat.",
    "The dog sat on the log.",
    "Birds fly over the sea.",
    "Привет, мир! Кошка сидит на ковре.",
    "Water is wet, fire is hot?!",
    "One, two, three: numbers 123 and 4567.",
    "It's the dog's bone; we'll see, they've said.",
]
DIALOGS = [
    ("Where is the cat?", "The cat sat on the mat."),
    ("Where is the dog?", "The dog sat on the log."),
    ("What flies?", "Birds fly over the sea."),
    ("Say hello", "Привет, мир!"),
    ("Count", "One, two, three."),
]
PROMPTS = ["The cat", "Birds", "Привет", "Water is", "It's the", "zebra 🙂 quantum?!"]
N_CTX = 256
F32_TOL = 1e-3  # of max|logit|: fp16 GELU table and fp16 KV cache in llama.cpp
Q8_TOL = 3e-2  # of max|logit|: llama.cpp also quantizes activations to q8_0 in its matmuls


def train_tiny(precision="fp32", **model):
    """Tokenizer (~360 tokens) + a 2-layer model memorising the lines and dialogs above (100 AdamW
    steps on the engine, a few seconds); precision: the matmuls' (clgpt/device/precision.py); model: ModelConfig keys."""
    tok = Tokenizer.train(PRETRAIN + [f"{u} {a}" for u, a in DIALOGS], 360)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=N_CTX, n_embd=64, n_head=2, n_layer=2, n_ff=128, **model)
    rows = [([tok.bos_id, *tok.encode(s), tok.eos_id], 0) for s in PRETRAIN]  # text: every target counts
    rows += [encode_dialog(tok, u, a) for u, a in DIALOGS]  # dialogs: the reply's targets count
    tokens, targets, mask, _ = pad_dialogs(rows, N_CTX)
    eng = Engine(cfg, init_params(cfg, 0), batch_size=tokens.shape[0], seq_len=tokens.shape[1], precision=precision, knobs=Knobs())
    for _ in range(100):
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        eng.step(1e-2, weight_decay=0.0)
    assert loss < 0.5, f"the tiny model did not learn (loss {loss:.3f})"
    return tok, cfg, eng.get_params()


_TRAINED = []  # (tok, cfg, params): trained once, on the first implementation


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, opencl):
    """The tiny model and its GGUF files. It is trained once, on the first implementation: each implementation's
    engine is then checked on the same weights against llama.cpp (training itself is checked on every
    implementation by tests/test_engine_contract.py; on rusticl this training took minutes)."""
    if not _TRAINED:
        _TRAINED.append(train_tiny())
    tok, cfg, params = _TRAINED[0]
    d = tmp_path_factory.mktemp("llama")
    paths = {}
    for ftype in ("f32", "q8_0"):
        paths[ftype] = str(d / f"tiny-{ftype}.gguf")
        export_gguf(paths[ftype], cfg, params, tok, ftype=ftype, name="clgpt-tiny")
    return tok, cfg, params, paths


def load_llama(path, n_ctx=N_CTX):
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, logits_all=True, verbose=False, seed=0)


@pytest.fixture(scope="module")
def llamas(tiny):
    _, _, _, paths = tiny
    return {ftype: load_llama(p) for ftype, p in paths.items()}


@pytest.fixture(scope="module")
def generators(tiny):
    """Our engine on the weights read back from each GGUF (dequantized for q8_0)."""
    _, _, _, paths = tiny
    out = {}
    for ftype, path in paths.items():
        cfg, params, _, _ = read_gguf(path)
        out[ftype] = Generator(cfg, params, knobs=Knobs())
    return out


def llama_logits(llm, ids) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)  # (T, V)


def llama_greedy(llm, ids, n) -> list[int]:
    out = []
    for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if len(out) == n:
            break
    return out


# ---- tokenizer ----------------------------------------------------------------------------------


def varied_strings(n=300, seed=0) -> list[str]:
    rng = np.random.default_rng(seed)
    pieces = [
        "the", "The", "cat", "sat", "mat", "dog", "log", "sea", "Birds", "fly", "over", "hello", "world",
        "?!", "?", "!", ",", ".", "...", ";", ":", "'s", "'ll", "'ve", "'re", "'d", "'m", "'t", "don't", "I'm",
        "12", "123", "4567", "3.14", "1,000", "-", "--", "(", ")", "\"", "#", "@", "$5", "100%",
        "Привет", "мир", "Кошка", "ковре", "ёж", "café", "naïve", "Straße", "ÆØÅ", "中文", "日本語", "한국어",
        "🙂", "🚀", "👍🏽", "❤️", "α", "β", "∑", "→", "½", "—",
        " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\r\n", "<s>", "</s>", "<user>", "<assistant>",
    ]
    out = ["", " ", "\n", "a", "  leading", "trailing  ", "Hello, world?!", "Привет, мир! 🙂 🚀"]
    while len(out) < n:
        k = int(rng.integers(1, 12))
        parts = [pieces[int(i)] for i in rng.integers(0, len(pieces), k)]
        seps = ["", " ", " ", " ", "  ", "\n"]
        out.append("".join(p + seps[int(rng.integers(0, len(seps)))] for p in parts))
    return out


def test_tokenizer_matches_llama_cpp(tiny, llamas):
    tok = tiny[0]
    llm = llamas["f32"]
    mismatches = []
    for s in varied_strings():
        ours = tok.encode(s)
        theirs = llm.tokenize(s.encode("utf-8"), add_bos=False, special=False) if s else []
        if ours != theirs:
            mismatches.append((s, ours, theirs))
    assert not mismatches, f"{len(mismatches)} strings tokenize differently, first: {mismatches[0]!r}"


def test_special_tokens_and_bos(tiny, llamas):
    tok = tiny[0]
    llm = llamas["f32"]
    # EOS is the end-of-turn token <|im_end|>: every client stops a chat reply there
    assert (llm.token_bos(), llm.token_eos(), llm.n_vocab()) == (tok.bos_id, tok.im_end_id, tok.vocab_size)
    # add_bos_token=True: a plain completion prompt gets BOS from llama.cpp, as our encode_* add it
    assert llm.tokenize(b"The cat", add_bos=True) == [tok.bos_id, *tok.encode("The cat")]
    # with special=True the names parse to the control tokens (what the chat template relies on)
    assert llm.tokenize(b"<s><|im_start|>user\nhi<|im_end|>", add_bos=False, special=True) == [
        tok.bos_id, tok.im_start_id, *tok.encode("user\nhi"), tok.im_end_id]
    assert llm.detokenize(tok.encode("Привет, мир! 🙂")).decode() == "Привет, мир! 🙂"


def test_eog_set_matches_llama_cpp(tiny, llamas):
    """Where generation stops: our reading of the GGUF's end-of-generation set is llama.cpp's, token by token."""
    tok, _, _, paths = tiny
    llm = llamas["f32"]
    theirs = {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i)}
    assert eog_ids(read_gguf(paths["f32"])[3]) == theirs == {tok.eos_id, tok.im_end_id}


# ---- logits and greedy completions --------------------------------------------------------------


def prompt_ids(tok):
    return [[tok.bos_id, *tok.encode(p)] for p in PROMPTS] + [encode_prompt(tok, u) for u, _ in DIALOGS[:2]]


def test_f32_logits_match(tiny, llamas, generators):
    tok, cfg, params, _ = tiny
    gen = generators["f32"]
    for ids in prompt_ids(tok):
        ref = reference.gpt_logits(params, cfg, np.array([ids]))[0]  # (T, V) float64
        ours = gen.engine.forward(np.array([ids], np.int32))[0].astype(np.float64)
        theirs = llama_logits(llamas["f32"], ids)
        scale = np.abs(ref).max()
        assert np.abs(ours - ref).max() <= 1e-5 * scale, f"engine vs reference: {np.abs(ours - ref).max():.3g}"
        diff = np.abs(theirs - ref).max()
        assert diff <= F32_TOL * scale, f"llama.cpp vs reference on {ids}: max diff {diff:.3g}, logit scale {scale:.3g}"
        np.testing.assert_allclose(gen.next_logits(ids), ours[-1], rtol=0, atol=1e-6 * scale)


def test_q8_0_logits_match(tiny, llamas, generators):
    tok = tiny[0]
    gen = generators["q8_0"]
    for ids in prompt_ids(tok):
        ours = gen.engine.forward(np.array([ids], np.int32))[0].astype(np.float64)
        theirs = llama_logits(llamas["q8_0"], ids)
        scale = np.abs(ours).max()
        diff = np.abs(theirs - ours).max()
        assert diff <= Q8_TOL * scale, f"q8_0 llama.cpp vs engine on {ids}: max diff {diff:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("ftype", ["f32", "q8_0"])
def test_greedy_completions_identical(tiny, llamas, generators, ftype):
    tok = tiny[0]
    for ids in prompt_ids(tok):
        ours = [t for t, _ in generators[ftype].generate(ids, max_tokens=24, greedy=True)]
        theirs = llama_greedy(llamas[ftype], ids, 24)
        assert ours == theirs, (
            f"{ftype} prompt {tok.decode(ids)!r}: ours {tok.decode(ours)!r}, llama.cpp {tok.decode(theirs)!r}")


# ---- chat -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ftype", ["f32", "q8_0"])
def test_chat_completion_matches(tiny, llamas, generators, ftype):
    """create_chat_completion renders the GGUF's tokenizer.chat_template; the prompt it evaluates must
    be our encode_prompt (BOS included), its greedy answer ours, and it must stop at `<|im_end|>`."""
    tok = tiny[0]
    llm = llamas[ftype]
    assert llm.chat_format == "chat_template.default", "llama-cpp-python must use the GGUF's own template"
    for user, answer in DIALOGS:
        r = llm.create_chat_completion(
            messages=[{"role": "user", "content": user}], temperature=0.0, repeat_penalty=1.0, max_tokens=64, seed=0
        )
        prompt = encode_prompt(tok, user)
        seen = [int(t) for t in llm.input_ids[: len(prompt)]]
        assert seen == prompt, (
            f"llama-cpp-python evaluated {seen} for {user!r}, our prompt is {prompt}: the chat template must "
            "start with {{ bos_token }} (llama-cpp-python adds no BOS to a templated chat prompt)"
        )
        ours = generators[ftype].generate(prompt, max_tokens=64, greedy=True, stop_ids=[tok.im_end_id])
        choice = r["choices"][0]
        assert choice["message"]["content"] == tok.decode([t for t, _ in ours])
        assert choice["message"]["content"] == answer, "the tiny model answers its training dialogs"
        assert choice["finish_reason"] == "stop" and len(ours) < 64, "generation stops at <|im_end|>"


FORCED_CHAT = textwrap.dedent(
    """
    import json, sys
    import llama_cpp
    path, ends, n_ctx = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, verbose=False, seed=0)
    r = llm.create_chat_completion(
        messages=[{"role": "user", "content": "Where is the cat?"}],
        temperature=0.0, repeat_penalty=1.0, max_tokens=100000, logit_bias={e: float("-inf") for e in ends},
    )
    print(json.dumps({"usage": r["usage"], "finish": r["choices"][0]["finish_reason"], "n_ctx": llm.n_ctx()}))
    """
)


@pytest.mark.parametrize("n_ctx", [N_CTX, 0])  # 0: llama.cpp takes the model's own context length
def test_chat_forced_past_eos_fills_context(tiny, n_ctx):
    """With `<|im_end|>` and `</s>` suppressed the reply runs to the end of the context; llama.cpp must stop there, not
    abort (an abort past position_embd's last row would kill the process, hence the subprocess)."""
    tok, _, _, paths = tiny
    proc = subprocess.run(
        [sys.executable, "-c", FORCED_CHAT, paths["f32"], json.dumps([tok.im_end_id, tok.eos_id]), str(n_ctx)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"llama.cpp exited {proc.returncode}: {proc.stderr[-2000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["n_ctx"] == N_CTX
    assert res["finish"] == "length"
    assert res["usage"]["total_tokens"] == N_CTX, res


def test_generator_forced_past_eos_fills_context(tiny, generators):
    tok = tiny[0]
    prompt = encode_prompt(tok, "Where is the cat?")
    out = generators["f32"].generate(
        prompt, max_tokens=100000, greedy=True, stop_ids=[tok.im_end_id], suppress_ids=[tok.im_end_id])
    assert len(prompt) + len(out) == N_CTX
    assert tok.im_end_id not in [t for t, _ in out]


def assert_export_matches_llama_cpp(path, tok, cfg, params, name, what):
    """Export (f32) to `path`, load it in llama.cpp: its logits match the float64 reference of the exported
    weights on every prompt, and greedy completions match our engine's."""
    export_gguf(path, cfg, params, tok, ftype="f32", name=name)
    llm = load_llama(path)
    gen = Generator(*read_gguf(path)[:2], knobs=Knobs())
    for ids in prompt_ids(tok):
        ref = reference.gpt_logits(params, cfg, np.array([ids]))[0]
        scale = np.abs(ref).max()
        diff = np.abs(llama_logits(llm, ids) - ref).max()
        assert diff <= F32_TOL * scale, f"llama.cpp vs reference on {ids}: max diff {diff:.3g}, logit scale {scale:.3g}"
        ours = [t for t, _ in gen.generate(ids, max_tokens=24, greedy=True)]
        assert ours == llama_greedy(llm, ids, 24), f"{what}, prompt {tok.decode(ids)!r}"


def test_bf16_trained_model_matches_llama_cpp(tmp_path):
    """A model trained with bf16 matmuls (fp32 master weights) exports as any other: llama.cpp's f32 logits
    match the float64 reference of the exported weights, and greedy completions match our engine's."""
    tok, cfg, params = train_tiny(precision="bf16")
    assert_export_matches_llama_cpp(str(tmp_path / "bf16.gguf"), tok, cfg, params, "clgpt-bf16", "bf16-trained")


def test_bias_off_model_matches_llama_cpp(tmp_path):
    """model.bias false (nanoGPT's bias=False): training leaves every bias tensor exactly zero, the export
    carries them as zeros (llama.cpp's gpt2 loader requires them), and llama.cpp's logits match the float64
    reference of the exported weights; greedy completions match our engine's."""
    tok, cfg, params = train_tiny(bias=False)
    biases = [n for n in params if n.endswith(".bias")]
    assert biases and all(not params[n].any() for n in biases), "a bias moved off zero"
    assert all(params[n].std() > 0 for n in params if n.endswith(".weight")), "a weight did not train"
    assert_export_matches_llama_cpp(str(tmp_path / "nobias.gguf"), tok, cfg, params, "clgpt-nobias", "bias off")
