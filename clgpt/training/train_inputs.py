"""What a training stage starts from: the encoded data, the model (a new one of the configured shape for
pretrain, the pretrained checkpoint for tune) and the sha256 of every input file, which key a resume.
Checked against each other here: one tokenizer for all the data, a vocabulary the model covers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from clgpt.data import DialogBatches, PretrainBatches, load_encoded
from clgpt.errors import ClgptError
from clgpt.io.checkpoint import load_checkpoint
from clgpt.model import ModelConfig, init_params


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class _Inputs:
    cfg: ModelConfig
    params: dict[str, np.ndarray]  # the starting weights
    batches: PretrainBatches | DialogBatches
    tokenizer_hash: str | None
    hashes: dict[str, str]  # sha256 of every input file: part of the resume key


def _pretrain_inputs(encoded: str, s: dict, model: dict | None, tokenizer_hash: str | None) -> _Inputs:
    ids, meta = load_encoded(encoded)
    if tokenizer_hash and meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tokenizer_hash:
        raise ClgptError(f"{encoded}: encoded with another tokenizer; re-run the encode stage")
    if meta.get("kind", "text") != "text":
        raise ClgptError(f"{encoded}: pretrain needs encoded text, this file holds {meta.get('kind')!r}")
    m = dict(model or {})
    unknown = sorted(set(m) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise ClgptError(f"model.{unknown[0]}: unknown key; known: {', '.join(ModelConfig.__dataclass_fields__)}")
    m["vocab_size"] = m.get("vocab_size") or int(meta["vocab_size"])
    cfg = ModelConfig.from_dict(m)
    cfg.validate()
    if cfg.vocab_size < meta["vocab_size"]:
        raise ClgptError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {meta['vocab_size']}")
    return _Inputs(cfg, init_params(cfg, s["seed"]), PretrainBatches(ids, s, encoded),
                   tokenizer_hash or meta.get("tokenizer_hash"), {"data": _sha256_file(encoded)})


def _tune_inputs(encoded: str, s: dict, init_ckpt: str | None, mix_encoded: str | None) -> _Inputs:
    if init_ckpt is None:
        raise ClgptError("tune needs init_ckpt, the pretrain checkpoint")
    init = load_checkpoint(init_ckpt)
    ids, meta = load_encoded(encoded)
    tok_hash = init["extra"].get("tokenizer_hash") or meta.get("tokenizer_hash")
    if tok_hash and meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tok_hash:
        raise ClgptError(
            f"{encoded}: encoded with another tokenizer than {init_ckpt} was trained with; re-run the encode stage"
        )
    if meta["vocab_size"] > init["cfg"].vocab_size:
        raise ClgptError(
            f"{encoded}: vocabulary of {meta['vocab_size']} is larger than the model's {init['cfg'].vocab_size}"
        )
    hashes = {"data": _sha256_file(encoded), "init": _sha256_file(init_ckpt)}
    mix_ids = None
    if s["mix_pretrain"] > 0:
        if mix_encoded is None:
            raise ClgptError("tune.mix_pretrain is above 0 but no pretrain data (mix_encoded) was given")
        mix_ids, mix_meta = load_encoded(mix_encoded)
        if tok_hash and mix_meta.get("tokenizer_hash") and mix_meta["tokenizer_hash"] != tok_hash:
            raise ClgptError(f"{mix_encoded}: encoded with another tokenizer; re-run the encode stage")
        hashes["mix"] = _sha256_file(mix_encoded)
    batches = DialogBatches(ids, meta, s, encoded, mix_ids, mix_encoded or "")
    return _Inputs(init["cfg"], init["params"], batches, tok_hash, hashes)
