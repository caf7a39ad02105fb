"""GGUF export and read-back: every key and tensor through gguf-py's own reader, quantization against
gguf.quants (bit-exact with ggml), shape refusals, atomic writes, and a fuzzed reader."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clgpt.errors import ClgptError
from clgpt.io import gguf as gguf_io
from clgpt.io.gguf import check_export_shape, export_gguf, read_gguf, write_modelfile
from clgpt.model import ModelConfig, init_params, param_shapes
from clgpt.text.chat import CHAT_TEMPLATE, OLLAMA_TEMPLATE
from clgpt.text.tokenizer import Tokenizer

TEXTS = [
    "The cat sat on the mat. The dog sat on the log!",
    "Hello, world? It's 2024: numbers 12345 and more numbers 678.",
    "Привет, мир! Кошка сидит на ковре.",
    "emoji 🙂🚀 and tabs\tand\nnewlines   with spaces",
]
SAMPLES = ["The cat sat.", "hello world?!", "Привет мир", "🙂 emoji, 12 numbers", "  spaces\n\nlines\t",
           "<s> not special"]
METADATA = {"pretrain_steps": 300, "tune_loss": 0.125, "corpus_hash": "abc123", "resumed": False, "losses": [1.5, 0.5]}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXTS * 3, 300)


def make_model(tok, n_embd=64, n_ff=128, n_layer=2, tied=True, seed=0):
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=256, n_embd=n_embd, n_head=2, n_layer=n_layer, n_ff=n_ff,
                      tied=tied)
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    for k, v in params.items():  # nonzero biases and norms so every tensor is checked
        if v.ndim == 1:
            params[k] = (v + rng.normal(0, 0.1, v.shape)).astype(np.float32)
    return cfg, params


@pytest.fixture(scope="module")
def model(tok):
    return make_model(tok)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tok, model):
    cfg, params = model
    d = tmp_path_factory.mktemp("gguf")
    paths = {}
    for ftype in gguf_io.FTYPES:
        paths[ftype] = str(d / f"model-{ftype}.gguf")
        export_gguf(paths[ftype], cfg, params, tok, ftype=ftype, name="clgpt-test", metadata=METADATA)
    return paths


def field(reader, key):
    f = reader.get_field(key)
    assert f is not None, f"key {key} missing"
    return f.contents()


@pytest.mark.parametrize("ftype", list(gguf_io.FTYPES))
def test_keys_read_back_with_gguf_reader(exports, tok, model, ftype):
    cfg, _ = model
    r = gguf.GGUFReader(exports[ftype])
    expected = {
        "general.architecture": "gpt2",
        "general.name": "clgpt-test",
        "general.file_type": gguf_io.FTYPES[ftype][1],
        "gpt2.context_length": cfg.n_ctx,
        "gpt2.embedding_length": cfg.n_embd,
        "gpt2.block_count": cfg.n_layer,
        "gpt2.feed_forward_length": cfg.n_ff,
        "gpt2.attention.head_count": cfg.n_head,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tok.gguf_tokens(),
        "tokenizer.ggml.token_type": tok.gguf_token_types(),
        "tokenizer.ggml.merges": tok.gguf_merges(),
        "tokenizer.ggml.bos_token_id": tok.bos_id,
        "tokenizer.ggml.eos_token_id": tok.im_end_id,
        "tokenizer.ggml.eot_token_id": tok.im_end_id,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": CHAT_TEMPLATE,
        "clgpt.config": cfg.to_json(),
        "clgpt.tokenizer_hash": tok.hash(),
        "clgpt.pretrain_steps": 300,
        "clgpt.tune_loss": 0.125,
        "clgpt.corpus_hash": "abc123",
        "clgpt.resumed": False,
        "clgpt.losses": "[1.5, 0.5]",
    }
    for key, want in expected.items():
        assert field(r, key) == want, key
    assert field(r, "gpt2.attention.layer_norm_epsilon") == pytest.approx(cfg.norm_eps, rel=1e-6)
    assert not any("time" in k or "date" in k for k in r.fields), "no timestamps: exports must be reproducible"


@pytest.mark.parametrize("ftype", list(gguf_io.FTYPES))
def test_tensors_read_back_with_gguf_reader(exports, model, ftype):
    cfg, params = model
    r = gguf.GGUFReader(exports[ftype])
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == list(param_shapes(cfg)), "tensor names and order follow param_shapes"
    qtype = gguf_io.FTYPES[ftype][0]
    for name, w in params.items():
        t = tensors[name]
        assert tuple(int(x) for x in t.shape) == tuple(reversed(w.shape)), name  # ggml ne = numpy shape reversed
        if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
            assert t.tensor_type == GGMLQuantizationType.F32, name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(w.shape), w, err_msg=name)
            continue
        assert t.tensor_type == qtype, name
        back = gguf.quants.dequantize(np.asarray(t.data), qtype).reshape(w.shape)
        if qtype == GGMLQuantizationType.F16:
            np.testing.assert_array_equal(np.asarray(t.data).reshape(w.shape), w.astype(np.float16), err_msg=name)
            np.testing.assert_allclose(back, w, rtol=1e-3, atol=1e-7, err_msg=name)
            continue
        # the stored bytes are exactly gguf-py's quantizer (bit-exact with ggml's)
        np.testing.assert_array_equal(np.asarray(t.data), gguf.quants.quantize(w, qtype), err_msg=name)
        # and the values stay within each 32-block's quantization error: half a step d = amax/127 for
        # q8_0; a whole step d = amax/8 for q4_0, whose levels -8..7 clip the end opposite the signed
        # max; plus the fp16 rounding of the stored scale (2^-11 relative) times the largest level
        amax = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True)
        levels, steps = (127, 0.5) if qtype == GGMLQuantizationType.Q8_0 else (8, 1.0)
        bound = amax / levels * (steps + levels * 2.0**-11)
        err = np.abs(back.reshape(-1, 32) - w.reshape(-1, 32))
        assert np.all(err <= bound + 1e-12), f"{name}: max err {err.max():.3g}"


@pytest.mark.parametrize("ftype", list(gguf_io.FTYPES))
def test_read_gguf_round_trip(exports, tok, model, ftype):
    cfg, params = model
    cfg2, params2, tok2, meta = read_gguf(exports[ftype])
    assert cfg2 == cfg
    assert list(params2) == list(params)
    qtype = gguf_io.FTYPES[ftype][0]
    for name, w in params.items():
        assert params2[name].dtype == np.float32 and params2[name].shape == w.shape
        if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
            np.testing.assert_array_equal(params2[name], w, err_msg=name)
        elif qtype == GGMLQuantizationType.F16:
            np.testing.assert_array_equal(params2[name], w.astype(np.float16).astype(np.float32), err_msg=name)
        else:  # what llama.cpp computes with: ggml's dequantization of ggml's quantization
            want = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
            np.testing.assert_array_equal(params2[name], want, err_msg=name)
    assert tok2.hash() == tok.hash() and tok2.vocab_size == tok.vocab_size
    assert tok2.special_ids == tok.special_ids
    for s in SAMPLES + TEXTS:
        assert tok2.encode(s) == tok.encode(s), s
    assert meta["clgpt.pretrain_steps"] == 300 and meta["clgpt.corpus_hash"] == "abc123"


def test_untied_output_round_trip(tmp_path, tok):
    cfg, params = make_model(tok, n_embd=32, n_ff=64, n_layer=1, tied=False)
    path = str(tmp_path / "untied.gguf")
    export_gguf(path, cfg, params, tok)
    cfg2, params2, _, _ = read_gguf(path)
    assert cfg2 == cfg and not cfg2.tied
    np.testing.assert_array_equal(params2["output.weight"], params["output.weight"])


def test_export_is_byte_identical(tmp_path, tok, model, exports):
    cfg, params = model
    again = str(tmp_path / "again.gguf")
    export_gguf(again, cfg, params, tok, ftype="q8_0", name="clgpt-test", metadata=dict(reversed(METADATA.items())))
    with open(again, "rb") as a, open(exports["q8_0"], "rb") as b:
        assert a.read() == b.read()


def test_check_export_shape_refusals():
    ok = ModelConfig(n_ctx=256, n_embd=64, n_head=2, n_ff=128)
    for ftype in gguf_io.FTYPES:
        check_export_shape(ok, ftype)
    odd = ModelConfig(n_ctx=256, n_embd=48, n_head=2, n_ff=128)
    check_export_shape(odd, "f32")
    check_export_shape(odd, "f16")
    with pytest.raises(ClgptError, match=r"model\.n_embd=48 is not a multiple of 32, which q8_0 needs"):
        check_export_shape(odd, "q8_0")
    with pytest.raises(ClgptError, match=r"model\.n_ff=100 is not a multiple of 32, which q4_0 needs"):
        check_export_shape(ModelConfig(n_ctx=256, n_embd=64, n_head=2, n_ff=100), "q4_0")
    with pytest.raises(ClgptError, match=r"model\.n_ctx=80 is not a multiple of 256"):
        check_export_shape(ModelConfig(n_ctx=80), "f32")
    with pytest.raises(ClgptError, match="q5_k"):
        check_export_shape(ok, "q5_k")


def test_export_refuses_bad_inputs(tmp_path, tok, model):
    cfg, params = model
    path = str(tmp_path / "bad.gguf")
    short_ctx = ModelConfig(**{**cfg.__dict__, "n_ctx": 64})
    with pytest.raises(ClgptError, match="n_ctx=64"):
        export_gguf(path, short_ctx, params, tok)
    with pytest.raises(ClgptError, match="tokenizer has"):
        export_gguf(path, ModelConfig(**{**cfg.__dict__, "vocab_size": cfg.vocab_size + 1}), params, tok)
    broken = dict(params, **{"blk.0.ffn_up.bias": np.full(cfg.n_ff, np.nan, np.float32)})
    with pytest.raises(ClgptError, match="NaN"):
        export_gguf(path, cfg, broken, tok)
    with pytest.raises(ClgptError, match="shape"):
        export_gguf(path, cfg, dict(params, **{"output_norm.bias": np.zeros(3, np.float32)}), tok)
    assert not os.listdir(tmp_path)


def test_failed_export_leaves_no_partial_file(tmp_path, tok, model, monkeypatch):
    cfg, params = model
    path = tmp_path / "model.gguf"
    export_gguf(str(path), cfg, params, tok, ftype="f16")
    before = path.read_bytes()

    def fail_midway(self, *args, **kwargs):
        self.fout[0].write(b"half a tensor")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail_midway)
    with pytest.raises(RuntimeError, match="disk full"):
        export_gguf(str(path), cfg, params, tok, ftype="f32")
    assert path.read_bytes() == before, "the previous export is untouched"
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"], "no .tmp left behind"


def test_write_modelfile(tmp_path):
    path = tmp_path / "Modelfile"
    write_modelfile(str(path), "model.gguf", ModelConfig(n_ctx=512))
    text = path.read_text()
    assert text.startswith("FROM ./model.gguf\n")
    assert f'TEMPLATE """{OLLAMA_TEMPLATE}"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "</s>"' in text
    assert "PARAMETER num_ctx 512\n" in text
    assert sorted(os.listdir(tmp_path)) == ["Modelfile"]


# ---- reading broken files -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A small valid q8_0 export whose bytes the fuzz tests corrupt."""
    tok = Tokenizer.train(TEXTS, 270)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=256, n_embd=32, n_head=2, n_layer=1, n_ff=32)
    path = str(tmp_path_factory.mktemp("small") / "small.gguf")
    export_gguf(path, cfg, init_params(cfg, 0), tok, ftype="q8_0")
    with open(path, "rb") as f:
        return f.read()


def read_bytes_as_gguf(tmp_path, data: bytes, name="x.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return read_gguf(str(path))


def test_missing_and_not_gguf(tmp_path):
    with pytest.raises(ClgptError, match="nope.gguf: cannot read"):
        read_gguf(str(tmp_path / "nope.gguf"))
    with pytest.raises(ClgptError, match="text.gguf: not a GGUF file"):
        read_bytes_as_gguf(tmp_path, b"hello, this is text\n", "text.gguf")
    with pytest.raises(ClgptError, match="empty.gguf"):
        read_bytes_as_gguf(tmp_path, b"", "empty.gguf")


def test_wrong_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ClgptError, match=r"falcon\.gguf: architecture 'falcon' is not 'gpt2'"):
        read_gguf(str(path))


def test_truncated_files(tmp_path, small_gguf):
    read_bytes_as_gguf(tmp_path, small_gguf)  # the intact file reads
    cuts = sorted(set(np.linspace(0, len(small_gguf) - 1, 60).astype(int)) | {4, 8, 23, 24, len(small_gguf) - 1})
    for n in cuts:
        with pytest.raises(ClgptError, match=r"x\.gguf: ") as e:
            read_bytes_as_gguf(tmp_path, small_gguf[:n])
        assert "\n" not in str(e.value)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes(tmp_path, data):
    with pytest.raises(ClgptError):
        read_bytes_as_gguf(tmp_path, data)
    with pytest.raises(ClgptError):  # random bytes behind a valid magic and version
        read_bytes_as_gguf(tmp_path, b"GGUF\x03\x00\x00\x00" + data)


@FUZZ
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8),
       header_only=st.booleans())
def test_corrupted_bytes(tmp_path, small_gguf, edits, header_only):
    """Bytes overwritten anywhere (or in the header and key/values, where lengths live): the reader
    returns a model or raises ClgptError; it never crashes with another exception or hangs."""
    data = bytearray(small_gguf)
    span = 4096 if header_only else len(data)
    for where, value in edits:
        data[int(where * span)] = value
    try:
        cfg, params, tok, _ = read_bytes_as_gguf(tmp_path, bytes(data))
    except ClgptError as e:
        assert "x.gguf" in str(e) and "\n" not in str(e)
    else:
        assert set(params) == set(param_shapes(cfg)) and tok.vocab_size == cfg.vocab_size
