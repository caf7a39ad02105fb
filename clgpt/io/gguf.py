"""GGUF export (f32 / f16 / q8_0 / q4_0) for llama.cpp, LM Studio and Ollama, and the read-back.

The file is a `gpt2` GGUF exactly as llama.cpp loads it (see REFERENCE.md): tensors under the names
`clgpt.model.param_shapes` gives them, numpy (out, in) matrices written as is (ggml `ne` is the numpy
shape reversed), the byte-level BPE as `tokenizer.ggml.*` in GPT-2's bytes-to-unicode spelling, the
chat format as `tokenizer.chat_template`, and provenance under `clgpt.*` keys. Nothing time-dependent is
written: identical inputs give byte-identical files.

Architectures: `gpt2` (above) and `llama` (RMSNorm, RoPE, SwiGLU, optional grouped-query heads and
mixture of experts: `llama.expert_count`, `llama.expert_used_count`, `ffn_gate_inp` and the stacked
`ffn_{gate,up,down}_exps` tensors). Q and K are written unpermuted: clgpt trains with llama.cpp's own RoPE
layout (adjacent pairs), so the Hugging Face converter's row permutation does not apply.

Context: llama.cpp pads the context it allocates up to a multiple of 256 positions and aborts
(GGML_ASSERT in get_rows) once generation passes the last row of `position_embd`. Export therefore
REFUSES an n_ctx that is not a multiple of 256 rather than padding the position table: padded rows
would be untrained positions the model silently runs on. Train with a 256-row (or 512, ...) table;
training sequences may still be shorter (seq_len <= n_ctx). A `llama` model has no position table:
`llama.context_length` is the n_ctx it was trained for (any value), and llama.cpp may allocate a longer
context without failing (it warns; quality past the trained length is whatever RoPE extrapolation gives).

Quantized types (q8_0, q4_0) quantize every 2-D tensor in blocks of 32 along its rows (ne[0], the
numpy last axis: n_embd, or n_ff for ffn_down); 1-D tensors (norms, biases) stay F32, as llama.cpp's
own quantizer keeps them.

The reader is a bounds-checked parser of its own rather than gguf.GGUFReader, which loops forever or
raises assorted exceptions on some corrupt files (an array length past the end of the file spins
without reading). Every length is checked against the bytes left before anything is allocated, so a
corrupt file gives one ClgptError line naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.quants import dequantize, quantize

from clgpt.atomic import disk_full_line, is_disk_full, write_text_atomic
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig, param_shapes
from clgpt.text.chat import CHAT_TEMPLATE, OLLAMA_TEMPLATE
from clgpt.text.tokenizer import SPECIAL_TOKENS, Tokenizer

ARCH = "gpt2"
ARCHS = ("gpt2", "llama")
CTX_MULTIPLE = 256  # llama.cpp pads its allocated context to this many positions
QK = 32  # block length of Q8_0 and Q4_0

# ftype name -> (GGML type of 2-D tensors, general.file_type: llama_ftype)
FTYPES: dict[str, tuple[GGMLQuantizationType, int]] = {
    "f32": (GGMLQuantizationType.F32, 0),  # LLAMA_FTYPE_ALL_F32
    "f16": (GGMLQuantizationType.F16, 1),  # LLAMA_FTYPE_MOSTLY_F16
    "q4_0": (GGMLQuantizationType.Q4_0, 2),  # LLAMA_FTYPE_MOSTLY_Q4_0
    "q8_0": (GGMLQuantizationType.Q8_0, 7),  # LLAMA_FTYPE_MOSTLY_Q8_0
}
QUANT_VERSION = 2  # general.quantization_version, as llama.cpp's converter writes it
_READ_TYPES = {t for t, _ in FTYPES.values()}


# ---- export -------------------------------------------------------------------------------------


class _Writer(GGUFWriter):
    """GGUFWriter that can write an empty typed array. gguf-py refuses them (add_array skips an empty
    list, _pack_val raises), but llama.cpp needs `tokenizer.ggml.merges` present even when a byte-level
    vocabulary has no merges ("cannot find tokenizer merges in model file")."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return bytes(head + self._pack("I", sub_type) + self._pack("Q", 0))
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def check_export_shape(cfg: ModelConfig, ftype: str) -> None:
    """Raise ClgptError naming the dimension when `ftype` cannot hold a tensor of `cfg`, or when the
    position table (n_ctx rows) is not a multiple of 256 (see the module docstring)."""
    if ftype not in FTYPES:
        raise ClgptError(f"export.type={ftype!r} is not one of {', '.join(FTYPES)}")
    if cfg.arch == "gpt2" and cfg.n_ctx % CTX_MULTIPLE:
        raise ClgptError(
            f"model.n_ctx={cfg.n_ctx} is not a multiple of {CTX_MULTIPLE}; llama.cpp allocates positions "
            f"in multiples of {CTX_MULTIPLE} and aborts past the table, so use 256, 512, ..."
        )
    if FTYPES[ftype][0] in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        for key in ("n_embd", "n_ff"):  # the row lengths (ne[0]) of the 2-D tensors
            if getattr(cfg, key) % QK:
                raise ClgptError(
                    f"model.{key}={getattr(cfg, key)} is not a multiple of {QK}, which {ftype} needs "
                    f"(rows are quantized in blocks of {QK}); use f32/f16 or change the shape"
                )


def _encode_tensor(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The bytes (or floats) GGUFWriter writes for one tensor: 1-D stays F32."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
        return w
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16)
    return quantize(w, qtype)  # uint8 (rows, bytes per row), bit-exact with ggml


def _add_meta(writer: GGUFWriter, key: str, value) -> None:
    """One provenance value, typed by its Python type (bool before int: bool is an int)."""
    if isinstance(value, (bool, np.bool_)):
        writer.add_key_value(key, bool(value), GGUFValueType.BOOL)
    elif isinstance(value, (int, np.integer)):
        writer.add_key_value(key, int(value), GGUFValueType.INT64)
    elif isinstance(value, (float, np.floating)):
        writer.add_key_value(key, float(value), GGUFValueType.FLOAT64)
    elif isinstance(value, str):
        writer.add_key_value(key, value, GGUFValueType.STRING)
    else:  # lists, dicts, None: canonical JSON text
        writer.add_key_value(key, json.dumps(value, sort_keys=True), GGUFValueType.STRING)


def export_gguf(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: dict[str, np.ndarray],
    tok: Tokenizer,
    ftype: str = "f32",
    name: str = "clgpt",
    metadata: dict | None = None,
) -> None:
    """Write the model as a llama.cpp-loadable `gpt2` or `llama` GGUF (cfg.arch) at `path` (atomically: path + ".tmp", then
    os.replace; a failure leaves no file behind). `metadata` keys become `clgpt.<key>` (training
    steps, losses, corpus/config hashes: anything deterministic; no timestamps)."""
    path = os.fspath(path)
    cfg.validate()
    check_export_shape(cfg, ftype)
    if tok.vocab_size != cfg.vocab_size:
        raise ClgptError(
            f"{path}: the tokenizer has {tok.vocab_size} tokens but model.vocab_size is {cfg.vocab_size}; "
            "export the tokenizer the model was trained with"
        )
    shapes = param_shapes(cfg)
    missing = [k for k in shapes if k not in params]
    extra = [k for k in params if k not in shapes]
    if missing or extra:
        raise ClgptError(f"{path}: parameters do not match the config (missing {missing[:3]}, unexpected {extra[:3]})")
    for k, shape in shapes.items():
        if tuple(params[k].shape) != shape:
            raise ClgptError(f"{path}: parameter {k} has shape {tuple(params[k].shape)}, the config needs {shape}")
        if not np.all(np.isfinite(params[k])):
            raise ClgptError(f"{path}: parameter {k} holds NaN or inf; the model diverged, do not export it")
    qtype, file_type = FTYPES[ftype]

    w = _Writer(None, cfg.arch)  # path given at write time so nothing is opened before the tmp file
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(QUANT_VERSION)
    w.add_context_length(cfg.n_ctx)  # llama: the context it was trained for
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    if cfg.arch == "llama":
        w.add_head_count_kv(cfg.kv_heads)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_base)
        w.add_vocab_size(cfg.vocab_size)
        if cfg.n_expert:
            w.add_expert_count(cfg.n_expert)
            w.add_expert_used_count(cfg.n_expert_used)
    else:
        w.add_layer_norm_eps(cfg.norm_eps)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok.gguf_tokens())
    w.add_token_types(tok.gguf_token_types())
    if tok.merges:
        w.add_token_merges(tok.gguf_merges())
    else:  # a byte-level vocabulary: the key must still be there
        w.add_key_value("tokenizer.ggml.merges", [], GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_bos_token_id(tok.bos_id)
    # <|im_end|> ends a chat turn: EOS and EOT, so llama.cpp, LM Studio and the bindings stop there.
    # </s>, the end of a plain-text document, is end-of-generation in llama.cpp by its name.
    w.add_eos_token_id(tok.im_end_id)
    w.add_eot_token_id(tok.im_end_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    w.add_key_value("clgpt.config", cfg.to_json(), GGUFValueType.STRING)
    w.add_key_value("clgpt.tokenizer_hash", tok.hash(), GGUFValueType.STRING)
    for key, value in sorted((metadata or {}).items()):
        if key in ("config", "tokenizer_hash"):
            raise ClgptError(f"{path}: metadata key {key!r} is reserved (clgpt.{key} is written by export)")
        _add_meta(w, f"clgpt.{key}", value)

    # the file's size, for a full disk's message: tokens (8-byte length + text, 4-byte type), merges, the
    # other keys (a few KiB, the chat template the largest), then the tensors, each aligned to 32 bytes
    needed = sum(len(t.encode("utf-8")) + 12 for t in tok.gguf_tokens()) + 8192
    needed += sum(len(m.encode("utf-8")) + 8 for m in (tok.gguf_merges() if tok.merges else []))
    for k in shapes:
        data = _encode_tensor(params[k], qtype)
        needed += data.nbytes + 32  # tensors are aligned to 32 bytes
        if data.dtype == np.uint8:
            w.add_tensor(k, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(k, data)

    tmp = path + ".tmp"
    try:
        w.write_header_to_file(path=Path(tmp))
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.flush()
        os.fsync(w.fout[0].fileno())
        w.close()
        os.replace(tmp, path)
    except BaseException as e:
        w.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if is_disk_full(e, path, needed):
            raise ClgptError(disk_full_line(path, needed)) from None
        if isinstance(e, OSError):
            raise ClgptError(f"{path}: cannot write the GGUF ({e.strerror or e})") from None
        raise


def write_modelfile(path: str | os.PathLike, gguf_name: str, cfg: ModelConfig) -> None:
    """An Ollama Modelfile next to the GGUF: the chat template, the stop tokens, and num_ctx pinned to
    the position table (Ollama's default context is longer and would run past it)."""
    text = (
        f"FROM ./{gguf_name}\n"
        f"TEMPLATE \"\"\"{OLLAMA_TEMPLATE}\"\"\"\n"
        'PARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "<|im_start|>"\n'
        'PARAMETER stop "</s>"\n'
        f"PARAMETER num_ctx {cfg.n_ctx}\n"
    )
    try:
        write_text_atomic(path, text)
    except OSError as e:
        if is_disk_full(e):
            raise ClgptError(disk_full_line(path, len(text.encode("utf-8")))) from None
        raise ClgptError(f"{path}: cannot write the Modelfile ({e.strerror or e})") from None


# ---- reading ------------------------------------------------------------------------------------


class _Corrupt(Exception):
    """Raised inside the parser; read_gguf turns it into a ClgptError naming the file."""


# GGUF value type -> struct format of its scalar (STRING=8 and ARRAY=9 are handled apart)
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_ARRAY_DEPTH = 3


class _Cursor:
    """Reads little-endian GGUF values from a bytes buffer; every read checks the bytes left."""

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Corrupt(f"truncated at byte {self.pos} (needs {n} more bytes, file has {len(self.buf)})")
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"string at byte {self.pos - n} is not UTF-8") from None

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALAR_FMT:
            return self.scalar(_SCALAR_FMT[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            if depth >= _MAX_ARRAY_DEPTH:
                raise _Corrupt("arrays nested too deep")
            itype, n = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALAR_FMT:
                size = struct.calcsize(_SCALAR_FMT[itype])
                raw = self.take(n * size)  # checks the length before allocating
                return np.frombuffer(raw, dtype=np.dtype(_SCALAR_FMT[itype])).tolist()
            if itype not in (8, 9):
                raise _Corrupt(f"unknown array element type {itype}")
            if n * 8 > len(self.buf) - self.pos:  # each string/array element takes >= 8 bytes
                raise _Corrupt(f"array of {n} elements runs past the end of the file")
            return [self.value(itype, depth + 1) for _ in range(n)]
        raise _Corrupt(f"unknown value type {vtype}")


def _parse(buf: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(key/values, tensors as float32 numpy arrays) of a GGUF file's bytes."""
    c = _Cursor(buf)
    if len(buf) < 4 or struct.unpack("<I", buf[:4])[0] != GGUF_MAGIC:
        raise _Corrupt("not a GGUF file (no GGUF magic)")
    c.take(4)
    version = c.scalar("<I")
    if version not in (2, 3):
        raise _Corrupt(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    kv: dict = {}
    for _ in range(n_kv):
        key = c.string()
        if key in kv:
            raise _Corrupt(f"key {key!r} appears twice")
        kv[key] = c.value(c.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I")
        if not 1 <= n_dims <= 4:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        ne = [c.scalar("<Q") for _ in range(n_dims)]
        ttype, offset = c.scalar("<I"), c.scalar("<Q")
        infos.append((name, ne, ttype, offset))
    align = kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Corrupt(f"general.alignment {align!r} is not a power of two")
    data_start = -(-c.pos // align) * align

    tensors: dict[str, np.ndarray] = {}
    for name, ne, ttype, offset in infos:
        if name in tensors:
            raise _Corrupt(f"tensor {name!r} appears twice")
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise _Corrupt(f"tensor {name!r} has unknown type {ttype}") from None
        if qtype not in _READ_TYPES:
            raise _Corrupt(f"tensor {name!r} has type {qtype.name}; clgpt reads F32, F16, Q8_0 and Q4_0")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(d == 0 for d in ne) or ne[0] % block:
            raise _Corrupt(f"tensor {name!r} has shape {ne}, not whole blocks of {block}")
        n_elem = 1
        for d in ne:
            n_elem *= d
        nbytes = n_elem // block * type_size
        start = data_start + offset
        if offset % align or start + nbytes > len(buf):
            raise _Corrupt(f"tensor {name!r} data (offset {offset}, {nbytes} bytes) lies past the end of the file")
        shape = tuple(reversed(ne))  # numpy order
        raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
        if qtype == GGMLQuantizationType.F32:
            arr = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            arr = raw.view(np.float16).reshape(shape)
        else:
            arr = dequantize(raw.reshape(*shape[:-1], shape[-1] // block * type_size), qtype)
        tensors[name] = np.array(arr, dtype=np.float32)
    return kv, tensors


def _tokenizer_from_gguf(kv: dict) -> Tokenizer:
    """Rebuild the BPE from tokenizer.ggml.tokens + merges, and check it spells the same vocabulary."""
    tokens, merges = kv.get("tokenizer.ggml.tokens"), kv.get("tokenizer.ggml.merges")
    if "tokenizer.ggml.model" not in kv:
        raise _Corrupt("carries no tokenizer (no tokenizer.ggml.* keys); use the tokenizer JSON file the model "
                       "was trained with (results/tokenizer/tokenizer.json), or re-export the model with clgpt")
    if kv.get("tokenizer.ggml.model") != "gpt2":
        raise _Corrupt(f"tokenizer.ggml.model is {kv.get('tokenizer.ggml.model')!r}, not 'gpt2'")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise _Corrupt("tokenizer.ggml.tokens is missing or not a list of strings")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise _Corrupt("tokenizer.ggml.merges is missing or not a list of strings")
    ids = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for k, m in enumerate(merges):
        left, sep, right = m.partition(" ")
        if not sep or left not in ids or right not in ids:
            raise _Corrupt(f"merge {k} {m!r} names tokens not in tokenizer.ggml.tokens")
        pairs.append((ids[left], ids[right]))
    try:
        tok = Tokenizer(pairs)
    except ValueError as e:
        raise _Corrupt(f"inconsistent merges ({e})") from None
    if tok.gguf_tokens() != tokens:
        bad = next((i for i, (a, b) in enumerate(zip(tok.gguf_tokens(), tokens)) if a != b), None)
        raise _Corrupt(
            f"tokenizer.ggml.tokens is not the clgpt byte-level layout (256 bytes, one token per merge in "
            f"merge order, then {SPECIAL_TOKENS}); first difference at id {bad}, {len(tokens)} tokens"
        )
    if kv.get("tokenizer.ggml.token_type") not in (None, tok.gguf_token_types()):
        raise _Corrupt("tokenizer.ggml.token_type does not mark exactly the special tokens as control")
    for key, want in (("bos", tok.bos_id), ("eos", tok.im_end_id)):
        got = kv.get(f"tokenizer.ggml.{key}_token_id", want)
        if got != want:
            raise _Corrupt(f"tokenizer.ggml.{key}_token_id is {got!r}, expected {want}")
    return tok


def _int_key(kv: dict, key: str) -> int:
    v = kv.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _Corrupt(f"key {key} is missing or not a positive integer (got {v!r})")
    return v


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer, dict]:
    """(cfg, float32 params, tokenizer, all key/values) of a clgpt `gpt2` or `llama` GGUF of any export type.

    Quantized tensors come back dequantized, exactly as llama.cpp sees them. The config is rebuilt from
    the `gpt2.*` / `llama.*` keys and the tensors (not from `clgpt.config`), so it is what llama.cpp runs.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        raise ClgptError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        kv, tensors = _parse(buf)
        if kv.get("general.type") == "adapter":
            raise _Corrupt("this is a LoRA adapter, not a model; run the merged model (model.gguf), or the base with "
                           "the adapter in llama.cpp (llama-cli -m lora/base.gguf --lora lora/adapter.gguf)")
        arch = kv.get("general.architecture")
        if arch not in ARCHS:
            raise _Corrupt(f"architecture {arch!r} is not 'gpt2' or 'llama'")
        tok = _tokenizer_from_gguf(kv)
        eps_key = f"{arch}.attention.layer_norm_{'rms_' if arch == 'llama' else ''}epsilon"
        eps = kv.get(eps_key)
        if not isinstance(eps, float) or not eps > 0:
            raise _Corrupt(f"{eps_key} is missing or not a positive float")
        extra_cfg = {}
        if arch == "llama":
            hkv = _int_key(kv, "llama.attention.head_count_kv")
            extra_cfg = dict(
                n_head_kv=0 if hkv == kv.get("llama.attention.head_count") else hkv,  # 0: one kv head per head
                rope_base=float(f"{kv.get('llama.rope.freq_base', 10000.0):.7g}"),
                n_expert=kv.get("llama.expert_count", 0),
                n_expert_used=kv.get("llama.expert_used_count", 0),
            )
            if kv.get("llama.rope.dimension_count") != _int_key(kv, "llama.embedding_length") // _int_key(
                    kv, "llama.attention.head_count"):
                raise _Corrupt("llama.rope.dimension_count is not the head dim (clgpt rotates whole heads)")
        cfg = ModelConfig(
            **extra_cfg,
            arch=arch,
            vocab_size=tok.vocab_size,
            n_ctx=_int_key(kv, f"{arch}.context_length"),
            n_embd=_int_key(kv, f"{arch}.embedding_length"),
            n_head=_int_key(kv, f"{arch}.attention.head_count"),
            n_layer=_int_key(kv, f"{arch}.block_count"),
            n_ff=_int_key(kv, f"{arch}.feed_forward_length"),
            tied="output.weight" not in tensors,
            norm_eps=float(f"{eps:.7g}"),  # stored as float32: 1e-5 comes back as 9.99999974738e-06
        )
        try:
            cfg.validate()
        except ClgptError as e:
            raise _Corrupt(str(e)) from None
        shapes = param_shapes(cfg)
        for k, shape in shapes.items():
            if k not in tensors:
                raise _Corrupt(f"tensor {k} is missing")
            if tensors[k].shape != shape:
                raise _Corrupt(f"tensor {k} has shape {tensors[k].shape}, the {arch}.* keys need {shape}")
            if not np.isfinite(tensors[k]).all():
                raise _Corrupt(f"tensor {k} holds NaN or inf")
        extra = sorted(set(tensors) - set(shapes))
        if extra:
            raise _Corrupt(f"unexpected tensors {extra[:3]}")
    except _Corrupt as e:
        raise ClgptError(f"{path}: {e}") from None
    except (ValueError, OverflowError, MemoryError, struct.error) as e:  # belt and braces for odd corruptions
        raise ClgptError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return cfg, {k: tensors[k] for k in shapes}, tok, kv
