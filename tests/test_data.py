"""The corpus readers and the encode stage: bad input names file and line; encoded files read back."""

import json
import os

import numpy as np
import pytest

from clgpt.text.chat import encode_dialog
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
from clgpt.text.tokenizer import Tokenizer


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
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, '
         '{"role": "assistant", "content": "c"}]}', "message 2: two user messages in a row"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
         '{"role": "assistant", "content": "c"}]}', "message 3: two assistant messages in a row"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
         '{"role": "user", "content": "c"}]}', "ends on a user turn"),
        ('{"messages": [{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}]}',
         "message 1: unknown role 'bot'"),
        ('{"messages": [{"role": "assistant", "content": "a"}]}', "message 1: the conversation must start with a user turn"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, '
         '{"role": "assistant", "content": "c"}]}', "message 2: a system message may only come first"),
        ('{"messages": [{"role": "system", "content": "s"}]}', "ends on a system turn"),
        ('{"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "b"}]}',
         'message 1: missing or empty "content"'),
        ('{"messages": [{"role": "user", "content": "a", "speaker": "x"}, {"role": "assistant", "content": "b"}]}',
         "message 1: unknown field 'speaker'"),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "id": 3}',
         "unknown field 'id' beside \"messages\""),
        ('{"messages": [{"role": "user", "content": "a<|im_end|>"}, {"role": "assistant", "content": "b"}]}',
         "chat marker"),
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
    expected, spans = encode_dialog(tok, "Hi!", "Hello, world!")
    assert ids.tolist() == expected and meta["loss_spans"] == [[list(s) for s in spans]]
    (a, b), = spans
    bounds, first_loss = load_documents(out, side)  # the binary index: starts, end, first counted position
    assert bounds.tolist() == [0, len(expected)] and first_loss.tolist() == [a]
    # the counted targets are the reply and <|im_end|>: targets a..b-1 predict ids a+1..b
    assert tok.decode(ids[a + 1 : b + 1].tolist()) == "Hello, world!<|im_end|>"
    assert tok.decode(ids[: a + 1].tolist()) == "<s><|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_multi_turn_dialog_counts_every_assistant_turn_and_only_those(tmp_path, tok):
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "The cat?"},
                {"role": "assistant", "content": "It sat on the mat."}]
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"user": "a", "assistant": "b"}) + "\n",
                   encoding="utf-8")
    out = str(tmp_path / "d.bin")
    meta = encode_dialog_files(tok, [str(src)], out, max_len=256)
    ids, side = load_encoded(out)
    bounds, _ = load_documents(out, side)
    doc = ids[bounds[0] : bounds[1]].tolist()
    counted = [doc[j + 1] for a, b in meta["loss_spans"][0] for j in range(a, b)]
    assert tok.decode(counted) == "Hello!<|im_end|>It sat on the mat.<|im_end|>"
    assert len(meta["loss_spans"]) == 2 and len(meta["loss_spans"][0]) == 2


def test_reply_starting_with_whitespace_names_file_and_line(tmp_path):
    """A tokenizer that merges "\n " makes "assistant\n  Hello" start its reply inside the "\n" token
    after the role: the prompt would not be a prefix of the training ids."""
    tok = Tokenizer.train(["assistant\n  Hello\n  there"] * 5, 270)
    assert tok.encode("\n ") == [256 + tok.merges.index((10, 32))]
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"user": "Hi", "assistant": "  Hello"}) + "\n", encoding="utf-8")
    with pytest.raises(ClgptError, match=r"d.jsonl:1: the assistant's reply starts with whitespace"):
        encode_dialog_files(tok, [str(src)], str(tmp_path / "d.bin"), max_len=256)


def test_dialog_longer_than_context_is_refused_without_output(tmp_path, tok):
    src = tmp_path / "d.jsonl"
    long = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Hi " * 50},
                         {"role": "assistant", "content": "ok"}]}
    src.write_text(json.dumps({"user": "Hi", "assistant": "ok"}) + "\n" + json.dumps(long) + "\n", encoding="utf-8")
    out = tmp_path / "d.bin"
    with pytest.raises(ClgptError, match=r"d.jsonl:2: dialog is \d+ tokens, longer than the context of 40"):
        encode_dialog_files(tok, [str(src)], str(out), max_len=40)
    assert list(tmp_path.iterdir()) == [src]


def test_truncated_encoded_file_is_refused(tmp_path, tok):
    src = tmp_path / "a.txt"
    src.write_text("The cat sat on the mat.\n", encoding="utf-8")
    out = tmp_path / "a.bin"
    encode_text_files(tok, [str(src)], str(out))
    out.write_bytes(out.read_bytes()[:-2])
    with pytest.raises(ClgptError, match="size does not match its sidecar"):
        load_encoded(str(out))
