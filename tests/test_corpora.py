"""Text corpora as users have them: document modes and input formats round-trip (newlines kept), streaming
and the process pool give the ids of encoding each document whole, the 90/10 split, every new bad input
as one line, validation during training with keep: best surviving a kill, the no-tune workflow, and a
byte-level vocabulary that llama.cpp loads."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from clgpt import data
from clgpt.data import corpus
from clgpt.data import (
    check_text_corpus,
    encode_text_files,
    load_documents,
    load_encoded,
    read_text,
    text_segments,
)
from clgpt.errors import ClgptError
from clgpt.text.tokenizer import Tokenizer

BOOK = "CHAPTER 1\n\nIt was a dark night.\n  The wind blew.\n\n\n\nCHAPTER 2\n\nMorning came.\n"
STORIES = "Once there was a cat.\n<|endoftext|>\nThe cat slept.\n\nThe end.\n<|endoftext|>\n"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([BOOK, STORIES, "Привет, мир!"], 300)


def _decode_docs(tok, path):
    ids, meta = load_encoded(path)
    bounds, _ = load_documents(path, meta)
    docs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        doc = ids[a:b].tolist()
        assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
        docs.append(tok.decode(doc[1:-1]))
    return docs


def _write(tmp_path, fmt, texts):
    """The texts as one .txt file each, one .jsonl file, or one .parquet file."""
    folder = tmp_path / fmt
    folder.mkdir()
    if fmt == "txt":
        for i, t in enumerate(texts):
            (folder / f"{i}.txt").write_text(t, encoding="utf-8", newline="")
    elif fmt == "jsonl":
        (folder / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), folder / "a.parquet")
    return data.text_corpus_files(str(folder))


EXPECTED = {
    ("file", None): [BOOK, STORIES],
    ("paragraph", None): ["CHAPTER 1", "It was a dark night.\n  The wind blew.", "CHAPTER 2", "Morning came.",
                          "Once there was a cat.\n<|endoftext|>\nThe cat slept.", "The end.\n<|endoftext|>"],
    ("line", None): ["CHAPTER 1", "It was a dark night.", "  The wind blew.", "CHAPTER 2", "Morning came.",
                     "Once there was a cat.", "<|endoftext|>", "The cat slept.", "The end.", "<|endoftext|>"],
    ("file", "<|endoftext|>"): [BOOK.strip(), "Once there was a cat.", "The cat slept.\n\nThe end."],
}


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
@pytest.mark.parametrize("document, separator", list(EXPECTED))
def test_document_modes_and_formats_round_trip(tmp_path, tok, fmt, document, separator):
    files = _write(tmp_path, fmt, [BOOK, STORIES])
    side = encode_text_files(tok, files, str(tmp_path / "out.bin"), document=document, separator=separator)
    docs = _decode_docs(tok, str(tmp_path / "out.bin"))
    assert docs == EXPECTED[(document, separator)]
    assert side["n_documents"] == len(docs) and side["document"] == document
    if document == "file" and separator is None:
        assert "\n\n\n\n" in docs[0]  # newlines kept, blank lines too


def test_crlf_and_bom_are_read_as_plain_newlines(tmp_path, tok):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes("\ufeffline one\r\nline two\r\n".encode())
    assert list(read_text(data.text_corpus_files(str(tmp_path / "t")), "file")) == ["line one\nline two\n"]


def test_streaming_in_small_chunks_gives_the_ids_of_whole_documents(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_CHARS", 7)  # where the readers and the encoder look them up
    monkeypatch.setattr(corpus, "SEGMENT_CHARS", 11)
    rng = random.Random(0)
    pieces = ["the ", "cat", " sat", "\n", "\n\n", " \n", "é", "<|endoftext|>", "\r\n", "12", ".", "  ", "Привет "]
    path = tmp_path / "f.txt"
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        path.write_text(text, encoding="utf-8", newline="")
        plain = text.replace("\r\n", "\n")
        for document, sep in (("file", None), ("paragraph", None), ("file", "<|endoftext|>")):
            whole = list(read_text([str(path)], document, sep))
            streamed, parts = [], []
            for seg, end in text_segments([str(path)], document, sep):
                parts += tok.encode(seg)
                if end:
                    streamed.append(parts)
                    parts = []
            assert streamed == [tok.encode(d) for d in whole], repr(text)
        if plain.strip():
            assert list(read_text([str(path)], "file")) == [plain]


def test_process_pool_gives_the_same_bytes(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(corpus, "SEGMENT_CHARS", 1000)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text(BOOK * 300)
    (tmp_path / "t" / "b.txt").write_text(STORIES * 300)
    files = data.text_corpus_files(str(tmp_path / "t"))
    tok.save(tmp_path / "tok.json")
    out = {}
    for workers in (1, 2):
        encode_text_files(tok, files, str(tmp_path / f"w{workers}.bin"), document="paragraph", workers=workers,
                          tokenizer_path=str(tmp_path / "tok.json"))
        out[workers] = [(tmp_path / f"w{workers}.{ext}").read_bytes() for ext in ("bin", "idx")]
    assert out[1] == out[2]


def test_split_holds_out_the_last_tenth_of_the_token_stream(tmp_path, tok):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text(BOOK * 20)
    files = data.text_corpus_files(str(tmp_path / "t"))
    encode_text_files(tok, files, str(tmp_path / "all.bin"), document="paragraph")
    side = encode_text_files(tok, files, str(tmp_path / "train.bin"), document="paragraph",
                             heldout_bin=str(tmp_path / "val.bin"), val_fraction=0.1)
    whole, _ = load_encoded(str(tmp_path / "all.bin"))
    train, _ = load_encoded(str(tmp_path / "train.bin"))
    val, val_meta = load_encoded(str(tmp_path / "val.bin"))
    n = len(whole)
    assert len(train) == int(n * 0.9) == side["split"]["split_at"]
    assert np.array_equal(np.concatenate([train, val]), whole)
    bounds, _ = load_documents(str(tmp_path / "val.bin"), val_meta)
    assert bounds[0] == 0 and bounds[-1] == len(val) and np.all(np.diff(bounds) > 0)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# ---- bad input: one line naming the file or folder and what to do ---------------------------------

def _folder(tmp_path, files: dict):
    d = tmp_path / "corpus"
    d.mkdir()
    for name, content in files.items():
        if name.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table(content), d / name)
        else:
            (d / name).write_text(content, encoding="utf-8")
    return str(d)


@pytest.mark.parametrize(
    "files, document, separator, message",
    [
        ({"a.txt": "", "b.txt": "  \n\n"}, "file", None, r"corpus: the corpus \(corpus.pretrain\) is empty"),
        ({"a.jsonl": '{"content": "x"}\n'}, "file", None, r'a.jsonl:1: no "text" string field'),
        ({"a.parquet": {"body": ["x"]}}, "file", None, r"a.parquet: no 'text' column \(columns: body\)"),
        ({"a.parquet": {"text": [1, 2]}}, "file", None, r"a.parquet: column 'text' holds int64"),
        ({"a.txt": "one story\n"}, "file", "<|endoftext|>", r"corpus: corpus.separator '<\|endoftext\|>' never occurs"),
        ({"a.txt": "x"}, "paragraph", "<|endoftext|>", r"corpus.separator works with corpus.document: file"),
        ({"a.txt": "x"}, "page", None, r"corpus.document='page': use one of file, paragraph, line"),
    ],
)
def test_bad_corpus_is_one_line_naming_it(tmp_path, files, document, separator, message):
    folder = _folder(tmp_path, files)
    with pytest.raises(ClgptError, match=message) as e:
        check_text_corpus(folder, data.text_corpus_files(folder), document, separator)
    assert "\n" not in str(e.value)


def test_a_bad_jsonl_line_past_the_first_names_its_line_when_encoding(tmp_path, tok):
    folder = _folder(tmp_path, {"a.jsonl": '{"text": "fine"}\n{"text": null}\n'})
    with pytest.raises(ClgptError, match=r'a.jsonl:2: no "text" string field'):
        encode_text_files(tok, data.text_corpus_files(folder), str(tmp_path / "o.bin"), document="file")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("o.")]  # nothing half-written


def test_bad_corpus_stops_the_workflow_at_parse_time(tmp_path):
    from test_pipeline import TINY, make_workdir, one_line_error, snakemake, write_config

    path = make_workdir(tmp_path / "wf")
    (path / "empty").mkdir()
    (path / "empty" / "a.txt").write_text("\n \n")
    write_config(path, {**TINY, "corpus": {**TINY["corpus"], "pretrain": "empty"}})
    r = snakemake(path, "-n", "model.gguf")
    assert r.returncode != 0
    # the file check (clgpt/data/preflight.py) speaks first: one line naming the key and the empty file
    assert "error: corpus.pretrain: empty/a.txt is empty" in one_line_error(r.stdout + r.stderr)
    assert not (path / "results").exists()


# ---- validation during training ------------------------------------------------------------------

TINY_MODEL = {"n_ctx": 32, "n_embd": 16, "n_head": 2, "n_layer": 1, "n_ff": 32}
VALIDATED = {"seed": 3, "steps": 24, "batch_size": 4, "seq_len": 16, "lr": 3e-2, "min_lr": 3e-2, "warmup_steps": 1,
             "eval_every": 4, "checkpoint_every": 5, "keep": "best"}


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory, tok):
    """A tiny model at a high learning rate memorises BOOK and gets worse on other text within a few steps."""
    d = tmp_path_factory.mktemp("val")
    (d / "a.txt").write_text(BOOK * 4)
    (d / "b.txt").write_text("The cat sat on a mat.\nDogs bark at night!\n" * 3)
    encode_text_files(tok, [str(d / "a.txt")], str(d / "train.bin"), document="file")
    encode_text_files(tok, [str(d / "b.txt")], str(d / "val.bin"), document="file")
    return d


def _train(d, tok, name, settings=VALIDATED, callback=None):
    from clgpt.training.train import run_stage

    return run_stage("pretrain", str(d / "train.bin"), settings, str(d / f"{name}.ckpt"), str(d / f"{name}.csv"),
                     model={**TINY_MODEL, "vocab_size": tok.vocab_size}, tokenizer_hash=tok.hash(),
                     heldout=str(d / "val.bin"), callback=callback)


def test_validation_logs_held_out_loss_and_keeps_the_best(split_corpus, tok):
    from clgpt.io.checkpoint import load_checkpoint

    d = split_corpus
    r = _train(d, tok, "full")
    rows = [line.split(",") for line in (d / "full.csv").read_text().splitlines()]
    assert rows[0][-1] == "val_loss"
    val = {int(row[0]): float(row[-1]) for row in rows[1:] if row[-1]}
    assert sorted(val) == [4, 8, 12, 16, 20, 24]
    best_step = min(val, key=val.get)
    assert r["best_step"] == best_step and r["best_val_loss"] == pytest.approx(val[best_step], abs=1e-6)
    assert best_step < 24  # lr 3e-2 on a tiny set overfits: the best is not the last step
    assert load_checkpoint(str(d / "full.ckpt"))["step"] == best_step
    last = _train(d, tok, "last", {**VALIDATED, "keep": "last"})
    assert load_checkpoint(str(d / "last.ckpt"))["step"] == 24 and last["best_step"] == best_step
    early = _train(d, tok, "early", {**VALIDATED, "patience": 1})
    assert early["stopped_early"] and early["steps"] == best_step + 4


class _Killed(Exception):
    """Stands for kill -9: nothing is saved on the way out."""


@pytest.mark.parametrize("kill_at", [7, 13])
def test_resume_after_a_kill_keeps_the_best_so_far(split_corpus, tok, kill_at):
    d = split_corpus
    if not (d / "full.ckpt").exists():
        _train(d, tok, "full")

    def kill(step, loss):
        if step == kill_at:
            raise _Killed

    with pytest.raises(_Killed):
        _train(d, tok, f"killed{kill_at}", callback=kill)
    assert (d / f"killed{kill_at}.ckpt.best").exists() and not (d / f"killed{kill_at}.ckpt").exists()
    r = _train(d, tok, f"killed{kill_at}")
    assert r["resumed_from"] == (kill_at // 5) * 5
    assert (d / f"killed{kill_at}.ckpt").read_bytes() == (d / "full.ckpt").read_bytes()
    assert not (d / f"killed{kill_at}.ckpt.best").exists()


# ---- the workflow without a tune stage -----------------------------------------------------------

@pytest.fixture(scope="module")
def no_tune_workdir(tmp_path_factory):
    from test_pipeline import TINY, make_workdir, snakemake, write_config

    path = make_workdir(tmp_path_factory.mktemp("notune") / "run")
    (path / "text").mkdir()
    (path / "text" / "book.txt").write_text(BOOK * 30, encoding="utf-8")
    config = {**TINY, "corpus": {"pretrain": "text", "document": "file", "tune": None},
              "tokenizer": {"vocab_size": 260}, "pretrain": {**TINY["pretrain"], "eval_every": 3}}
    write_config(path, config)
    r = snakemake(path, "model.gguf")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return path


def test_no_tune_dag_ships_the_pretrained_model(no_tune_workdir):
    from test_pipeline import planned_rules

    path = no_tune_workdir
    assert not (path / "results" / "tune").exists() and not (path / "results" / "encoded" / "tune.bin").exists()
    assert planned_rules(path, "--forceall") == {"train_tokenizer", "encode", "pretrain", "evaluate", "export"}
    m = json.loads((path / "results" / "eval" / "metrics.json").read_text())
    assert m["tuned"] is False and m["answers"] == {} and len(m["samples"]) == 3
    h = m["heldout"]["pretrain"]
    assert h["bytes"] > 0 and h["nats_per_byte_pretrained"] == pytest.approx(
        h["loss_pretrained"] * h["tokens"] / h["bytes"])
    assert m["training"]["pretrain"]["best_step"] in (3, 6)
    report = (path / "results" / "eval" / "report.md").read_text()
    assert "nats per byte" in report and "Sampled continuations" in report
    assert "Forgetting" not in report and "Answers to" not in report
    assert not (path / "results" / "eval" / "loss_tune.png").exists()


def test_no_tune_gguf_is_byte_level_and_loads_in_llama_cpp(no_tune_workdir):
    import llama_cpp

    from clgpt.io.gguf import read_gguf

    path = str(no_tune_workdir / "model.gguf")
    _, _, gguf_tok, kv = read_gguf(path)
    assert kv["tokenizer.ggml.merges"] == [] and len(kv["tokenizer.ggml.tokens"]) == 260
    assert gguf_tok.merges == [] and "clgpt.pretrain_steps" in kv and "clgpt.tune_steps" not in kv
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, verbose=False, seed=0)
    text = "It was a dark night.\n\nПривет 🙂"
    tok = Tokenizer([])
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text)
    assert llm.detokenize(tok.encode(text)).decode() == text
    out = llm("CHAPTER", max_tokens=8, temperature=0.0)
    assert isinstance(out["choices"][0]["text"], str)


def test_snakemake_report_shows_the_evaluation(no_tune_workdir):
    from test_pipeline import snakemake

    r = snakemake(no_tune_workdir, "--report", "report.html", "model.gguf")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    html = (no_tune_workdir / "report.html").read_text(errors="replace")
    assert "loss_pretrain.png" in html and "report.md" in html
