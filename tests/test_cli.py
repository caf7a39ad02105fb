"""The command line, as a user runs it: `python -m clgpt ...` in a subprocess."""

import json
import subprocess
import sys

import numpy as np
import pytest

from clgpt.inference.generate import Generator, eog_ids
from clgpt.inference.interactive import stream_text
from clgpt.io.gguf import export_gguf, read_gguf
from clgpt.model import ModelConfig, init_params
from clgpt.text.chat import encode_prompt
from clgpt.text.tokenizer import Tokenizer
from clgpt.device.knobs import Knobs

TEXTS = ["The cat sat on the mat.", "Water boils at one hundred degrees.", "Кошка сидит на коврике!"]


def clgpt(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "clgpt", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    tok = Tokenizer.train(TEXTS, 300)
    tok.save(str(d / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=256, n_embd=32, n_head=2, n_layer=1, n_ff=64)
    params = init_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    params = {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in params.items()}  # peaked logits
    export_gguf(str(d / "m.gguf"), cfg, params, tok)
    return d, tok


def test_devices_lists_the_chosen_one():
    out = clgpt("devices").stdout
    assert any(line.startswith("*") for line in out.splitlines()), out


@pytest.mark.parametrize("text", ["Hello, world!", "What?! No...", "<user> typed by hand", "Привет, мир"])
def test_tokenize_prints_json_ids(model, text):
    d, tok = model
    for source in ("tokenizer.json", "m.gguf"):
        assert json.loads(clgpt("tokenize", str(d / source), text).stdout) == tok.encode(text)


def test_train_tokenizer_writes_a_loadable_file(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out = tmp_path / "tok.json"
    clgpt("train-tokenizer", str(src), "--vocab-size", "280", "--out", str(out))
    assert Tokenizer.load(str(out)).vocab_size == 280


def test_generate_prints_only_the_continuation(model):
    d, tok = model
    cfg, params, tok2, kv = read_gguf(str(d / "m.gguf"))
    gen = Generator(cfg, params, knobs=Knobs())
    eog = eog_ids(kv)
    assert eog == {tok.eos_id, tok.im_end_id}  # </s> by its name, <|im_end|> as EOS and EOT
    expected = gen.generate([tok.bos_id, *tok.encode("The cat")], max_tokens=8, greedy=True, stop_ids=eog)
    out = clgpt("generate", str(d / "m.gguf"), "--prompt", "The cat", "--greedy", "--max-tokens", "8").stdout
    assert out == tok.decode([i for i, _ in expected]) + "\n"

    expected = gen.generate(encode_prompt(tok, "Hi?"), max_tokens=8, greedy=True, stop_ids=eog)
    out = clgpt("generate", str(d / "m.gguf"), "--chat", "Hi?", "--greedy", "--max-tokens", "8").stdout
    assert out == tok.decode([i for i, _ in expected]) + "\n"

    # a conversation: flags in order, or the same messages as a JSON file
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "The cat."}, {"role": "user", "content": "Water?"}]
    expected = gen.generate(encode_prompt(tok, messages), max_tokens=8, greedy=True, stop_ids=eog)
    flags = [x for m in messages for x in (f"--{m['role']}", m["content"])]
    out = clgpt("generate", str(d / "m.gguf"), *flags, "--greedy", "--max-tokens", "8").stdout
    assert out == tok.decode([i for i, _ in expected]) + "\n"
    (d / "chat.json").write_text(json.dumps({"messages": messages}))
    out = clgpt("generate", str(d / "m.gguf"), "--chat", str(d / "chat.json"), "--greedy", "--max-tokens", "8").stdout
    assert out == tok.decode([i for i, _ in expected]) + "\n"


def test_generate_chat_bad_order_is_one_line_error(model):
    d, _ = model
    r = clgpt("generate", str(d / "m.gguf"), "--user", "a", "--user", "b", check=False)
    assert r.returncode == 1
    assert r.stderr == "error: generate: message 2: two user messages in a row; user and assistant turns alternate, starting with user\n"


def test_generate_show_probs_and_seeded_sampling(model):
    d, _ = model
    args = ("generate", str(d / "m.gguf"), "--prompt", "Water", "--max-tokens", "6", "--seed", "7")
    a, b = clgpt(*args).stdout, clgpt(*args).stdout
    assert a == b  # same seed, same text
    rows = clgpt(*args, "--show-probs").stdout.splitlines()
    assert rows and all(0.0 < float(r.split()[0]) <= 1.0 for r in rows)


def test_generate_stops_at_eog_unless_ignore_eos(tmp_path):
    """A model whose most likely next token is always `</s>` or `<|im_end|>` (their output rows scaled up): every mode
    stops at once; with --ignore-eos it runs to --max-tokens and never draws either (llama.cpp's -inf bias)."""
    tok = Tokenizer.train(TEXTS, 300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=256, n_embd=32, n_head=2, n_layer=1, n_ff=64, tied=False)
    params = init_params(cfg, seed=3)
    for end in (tok.eos_id, tok.im_end_id):
        # LayerNorm's output has zero mean over the channels: with output_norm.bias = 1 it is 1 along ones(C) for
        # every input, so the row ones(C) scores C there, the others next to nothing
        p = {**params, "output_norm.bias": np.ones(cfg.n_embd, np.float32), "output.weight": params["output.weight"].copy()}
        p["output.weight"][end] = 1.0
        path = str(tmp_path / f"end{end}.gguf")
        export_gguf(path, cfg, p, tok)
        gen = Generator(*read_gguf(path)[:2], knobs=Knobs())
        for mode in (("--prompt", "The cat"), ("--chat", "Hi?")):
            ids = [tok.bos_id, *tok.encode("The cat")] if mode[0] == "--prompt" else encode_prompt(tok, "Hi?")
            assert [t for t, _ in gen.generate(ids, max_tokens=5, greedy=True)][:1] == [end], "the setup: end first"
            assert clgpt("generate", path, *mode, "--greedy").stdout == "\n"
            rows = clgpt("generate", path, *mode, "--ignore-eos", "--max-tokens", "12", "--show-probs").stdout.splitlines()
            assert len(rows) == 12 and not {int(r.split()[1]) for r in rows} & {tok.eos_id, tok.im_end_id}, rows


class _Writes:
    def __init__(self):
        self.parts, self.flushed = [], 0

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        self.flushed = len(self.parts)


def test_stream_holds_back_a_split_character():
    """Byte tokens that split 2-, 3- and 4-byte characters: each write is whole characters (no U+FFFD), flushed
    as soon as a character completes; the text is tok.decode's."""
    tok = Tokenizer.train(TEXTS, 300)
    text = "Жёлтый 中文 🙂!"
    ids = list(text.encode("utf-8"))  # ids 0..255 are the byte tokens
    out = _Writes()
    seen = []

    def tokens():
        for i in ids:
            seen.append(len(out.parts))
            yield i

    assert stream_text(tok, tokens(), out) == ids
    assert "".join(out.parts) == tok.decode(ids) == text
    assert "\ufffd" not in "".join(out.parts)
    assert [p for p in out.parts if p] == list(text)  # one write a character, at its last byte
    assert out.flushed == len(out.parts)
    truncated = _Writes()
    stream_text(tok, text.encode("utf-8")[:-1], truncated)  # a reply cut inside the emoji
    assert "".join(truncated.parts) == tok.decode(text.encode("utf-8")[:-1])


@pytest.mark.parametrize("content", [b"", b"not a gguf at all", b"GGUF\x03\x00\x00\x00\x05"])
def test_bad_gguf_is_a_one_line_error(tmp_path, content):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    r = clgpt("generate", str(p), "--prompt", "x", check=False)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(p) in lines[0]


def test_generate_needs_prompt_or_chat(model):
    d, _ = model
    r = clgpt("generate", str(d / "m.gguf"), check=False)
    assert r.returncode == 1 and "--prompt" in r.stderr
