"""The corpus readers and the encode stage: bad input names file and line; encoded files read back."""

import json
import os

import numpy as np
import pytest

from clgpt.chat import encode_dialog
from clgpt.data import (
    corpus_files,
    encode_dialog_files,
    encode_text_files,
    load_documents,
    load_encoded,
    read_dialogs,
    read_text,
)
from clgpt.errors import ClgptError
from clgpt.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(["The cat sat on the mat.", "Кошка сидит на коврике.", "Hello, world!"], 300)


def test_missing_and_empty_corpus_folders(tmp_path):
    with pytest.raises(ClgptError, match="does not exist"):
        corpus_files(str(tmp_path / "nope"), ".txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ClgptError, match=r"empty: no \*\.txt files"):
        corpus_files(str(tmp_path / "empty"), ".txt")


def test_not_utf8_reports_file_and_byte_offset(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"good line\nbad \xff here\n")
    with pytest.raises(ClgptError) as e:
        list(read_text([str(p)]))
    assert f"{p}: not UTF-8 at byte offset 14 (line 2)" in str(e.value)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"user": "hi"', "not valid JSON"),
        ('{"user": "hi"}', 'missing or empty "assistant"'),
        ('{"user": "", "assistant": "x"}', 'missing or empty "user"'),
        ('["hi", "there"]', "expected an object"),
        ('{"user": "a", "assistant": "b", "system": "c"}', "unknown field 'system'"),
    ],
)
def test_bad_dialog_names_file_and_line(tmp_path, line, message):
    p = tmp_path / "d.jsonl"
    p.write_text('{"user": "ok", "assistant": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ClgptError) as e:
        read_dialogs([str(p)])
    assert str(e.value).startswith(f"{p}:2: ") and message in str(e.value)


def test_text_encoding_round_trip(tmp_path, tok):
    src = tmp_path / "a.txt"
    src.write_text("The cat sat.\n\nКошка сидит.\n", encoding="utf-8")
    out = str(tmp_path / "enc" / "a.bin")
    os.makedirs(os.path.dirname(out))
    meta = encode_text_files(tok, [str(src)], out)
    ids, side = load_encoded(out)
    assert side == meta and side["kind"] == "text" and side["n_documents"] == 2
    assert ids.dtype == np.uint16 and len(ids) == side["n_tokens"]
    bounds, _ = load_documents(out, side)  # the binary index beside the ids
    s, e = bounds[1], bounds[2]
    assert ids[s] == tok.bos_id and ids[e - 1] == tok.eos_id
    assert tok.decode(ids[s + 1 : e - 1].tolist()) == "Кошка сидит."
    assert side["tokenizer_hash"] == tok.hash()
    assert not [f for f in os.listdir(os.path.dirname(out)) if f.endswith(".tmp")]


def test_dialog_encoding_marks_assistant(tmp_path, tok):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"user": "Hi!", "assistant": "Hello, world!"}) + "\n", encoding="utf-8")
    out = str(tmp_path / "d.bin")
    meta = encode_dialog_files(tok, [str(src)], out, max_len=256)
    ids, side = load_encoded(out)
    expected, start = encode_dialog(tok, "Hi!", "Hello, world!")
    bounds, assistant_pos = load_documents(out, side)
    assert ids.tolist() == expected and assistant_pos.tolist() == [start] and bounds.tolist() == [0, len(expected)]
    assert ids[start] == tok.assistant_id


def test_dialog_longer_than_context_is_refused_without_output(tmp_path, tok):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"user": "Hi " * 50, "assistant": "ok"}) + "\n", encoding="utf-8")
    out = tmp_path / "d.bin"
    with pytest.raises(ClgptError, match=r"d.jsonl:1: dialog is \d+ tokens, longer than the context of 20"):
        encode_dialog_files(tok, [str(src)], str(out), max_len=20)
    assert list(tmp_path.iterdir()) == [src]


def test_truncated_encoded_file_is_refused(tmp_path, tok):
    src = tmp_path / "a.txt"
    src.write_text("The cat sat on the mat.\n", encoding="utf-8")
    out = tmp_path / "a.bin"
    encode_text_files(tok, [str(src)], str(out))
    out.write_bytes(out.read_bytes()[:-2])
    with pytest.raises(ClgptError, match="size does not match its sidecar"):
        load_encoded(str(out))
