"""The embedded tune data's system prompts (data/system/pool.txt for training, data/heldout/system.txt for
the evaluation only): the committed conversations are what data/compose_chats.py writes, the held-out
prompts are new to training and include paragraph-length defaults, and with the tokenizer the pipeline
trains, the longest tune conversation fits tune.seq_len and every evaluation conversation and its reply fit n_ctx."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from clgpt.data import dialog_texts, read_dialogs, text_segments
from clgpt.text.chat import PARAGRAPH_WORDS, encode_chat, encode_prompt, heldout_systems, system_probes
from clgpt.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
TUNE_FILES = sorted(str(p) for p in (DATA / "tune").glob("*.jsonl"))
CYRILLIC = set("абвгдеёжзийклмнопрстуфхцчшщъыьэюя")


def prompts(name: str) -> list[str]:
    return (DATA / name).read_text(encoding="utf-8").splitlines()


def test_compose_chats_writes_the_committed_conversations(tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(DATA, copy)
    _compose_module(copy).main()
    for f in ("tune/chat.jsonl", "heldout/tune.jsonl"):
        assert (copy / f).read_bytes() == (DATA / f).read_bytes(), f"{f}: run python data/compose_chats.py"


def test_pool_is_varied_and_heldout_prompts_are_new():
    pool, heldout = prompts("system/pool.txt"), prompts("heldout/system.txt")
    assert len(set(pool)) == len(pool) and len(set(heldout)) == len(heldout)
    assert not set(pool) & set(heldout)
    for name, lines in (("pool", pool), ("heldout", heldout)):
        russian = [s for s in lines if CYRILLIC & set(s.lower())]
        paragraphs = [s for s in lines if len(s.split()) >= PARAGRAPH_WORDS]
        assert russian and len(russian) < len(lines), name
        assert len(paragraphs) >= 3 and len(lines) - len(paragraphs) >= 3, name
        assert all(s == s.strip() and s for s in lines), name
    # the evaluation finds the held-out prompts in the held-out dialogs: all of them, and only them
    assert sorted(heldout_systems(read_dialogs(TUNE_FILES), read_dialogs([str(DATA / "heldout/tune.jsonl")]))) == sorted(heldout)
    trained = {d["messages"][0]["content"] for d in read_dialogs(TUNE_FILES) if d["messages"][0]["role"] == "system"}
    assert trained == set(pool)


@pytest.fixture(scope="module")
def tok():
    """The tokenizer the default run trains (scripts/train_tokenizer.py: pretrain text, then the tune dialogs)."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    texts = [seg for seg, _ in text_segments(sorted(str(p) for p in (DATA / "pretrain").glob("*.txt")), "line")]
    return Tokenizer.train([*texts, *dialog_texts(read_dialogs(TUNE_FILES))], config["tokenizer"]["vocab_size"])


def test_longest_conversations_fit_seq_len_and_n_ctx(tok):
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    seq_len, n_ctx = config["tune"]["seq_len"], config["model"]["n_ctx"]
    assert seq_len <= n_ctx
    longest = max(len(encode_chat(tok, d["messages"])[0]) - 1 for d in read_dialogs(TUNE_FILES))
    assert longest <= seq_len, f"the longest tune conversation has {longest} tokens; raise tune.seq_len"
    assert max(len(tok.encode(s)) for s in prompts("system/pool.txt")) <= 140  # paragraphs of about 120-135 tokens
    # the evaluation's conversations: each tune question after each held-out prompt, as the 3rd turn
    singles = [d for d in read_dialogs(TUNE_FILES) if len(d["messages"]) == 2]
    pairs = [(d["messages"][0]["content"], d["messages"][1]["content"]) for d in singles]
    reply_to = dict(pairs)
    for system in prompts("heldout/system.txt"):
        for _, opening, questions, expected in system_probes(pairs, [system]):
            before = [m for q in questions[:-1] for m in ({"role": "user", "content": q},
                                                           {"role": "assistant", "content": reply_to[q]})]
            ids = encode_prompt(tok, [*opening, *before, {"role": "user", "content": questions[-1]}])
            # room for the reply and its <|im_end|>
            assert len(ids) + len(tok.encode(expected)) + 1 <= n_ctx, (system[:40], questions)


def _key(text: str) -> str:
    """Case and punctuation aside, as data/compose_chats.py compares prompts."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def test_heldout_questions_stay_apart_from_the_tune_data():
    """No held-out question is asked anywhere in the tune data (case and punctuation aside); the held-out
    split holds everyday openers in both languages, and each of its questions has an acceptable-reply rule,
    each rule a held-out question."""
    asked = {_key(m["content"]) for d in read_dialogs(TUNE_FILES) for m in d["messages"] if m["role"] == "user"}
    heldout = [d["messages"][0]["content"] for d in read_dialogs([str(DATA / "heldout/tune.jsonl")])
               if [m["role"] for m in d["messages"]] == ["user", "assistant"]]
    assert len(heldout) == len(set(heldout)) >= 40
    assert [q for q in heldout if _key(q) in asked] == []
    russian = [q for q in heldout if CYRILLIC & set(q.lower())]
    assert len(russian) >= 12 and len(heldout) - len(russian) >= 12
    rules = json.loads((DATA / "heldout/accept.json").read_text(encoding="utf-8"))
    assert sorted(rules["prompts"]) == sorted(heldout)
    # a greeting among them, answered by its act rather than by one sentence
    assert any(rules["prompts"][q].get("act") == "greeting" for q in russian)
    # the tune data holds paraphrases of every hand-written tune question, made by compose_chats.py's rules
    # (those that happen to be a held-out question are left out: checked above)
    mod = _compose_module(DATA)
    lang = lambda q: "ru" if CYRILLIC & set(q.lower()) else "en"  # noqa: E731
    written = [d["messages"][0]["content"] for f in ("en", "ru") for d in read_dialogs([str(DATA / f"tune/{f}.jsonl")])]
    assert [q for q in written if not any(_key(p) in asked for p in mod.paraphrases(q, lang(q)))] == []


def test_heldout_conversations_fit_n_ctx(tok):
    """Each held-out turn the evaluation asks, with the conversation before it and the expected reply."""
    n_ctx = yaml.safe_load((ROOT / "config.yaml").read_text())["model"]["n_ctx"]
    for d in read_dialogs([str(DATA / "heldout/tune.jsonl")]):
        msgs = d["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                ids = encode_prompt(tok, msgs[:i])
                assert len(ids) + len(tok.encode(m["content"])) + 1 <= n_ctx, d["source"]


def _compose_module(data: Path):
    spec = importlib.util.spec_from_file_location("compose_chats", data / "compose_chats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_corpus_line_is_asked_in_the_tune_data():
    """compose_chats.py's rules make questions of every line of pretrain/ (a subject and a relation read off the
    line: "Madrid is the capital of Spain." -> "Which city is the capital of Spain?"), and the tune data asks
    them: each line is the source of at least one tune question, and its replies say the line's words."""
    mod = _compose_module(DATA)
    asked = {m["content"]: d["messages"][i + 1]["content"] for d in read_dialogs(TUNE_FILES)
             for i, m in enumerate(d["messages"]) if m["role"] == "user"}
    made = mod.corpus_questions(DATA / "pretrain")
    known = mod.known_words(DATA / "pretrain")
    for lang, rules in (("en", mod.en_line_questions), ("ru", mod.ru_line_questions)):
        for line in (DATA / f"pretrain/{lang}.txt").read_text(encoding="utf-8").splitlines():
            pairs = rules(line, known)
            assert pairs, f"no rule asks about {line!r}"
            assert any(q in asked for q, _ in pairs), f"the tune data asks nothing made of {line!r}"
            for q, reply in pairs:
                assert mod.stems(reply) <= mod.stems(line) | mod.stems(q) | {"это"}, (q, reply, line)
    assert sum(len(v) for v in made.values()) >= 600


def test_compose_chats_keeps_the_heldout_questions_out(tmp_path):
    """A held-out prompt that a rule would make (another case and punctuation) is left out of the tune data;
    a held-out prompt that a hand-written tune dialog asks stops compose_chats.py with a one-line error."""
    copy = tmp_path / "data"
    shutil.copytree(DATA, copy)
    mod = _compose_module(copy)
    made = mod.corpus_questions(copy / "pretrain")["en"]
    question = next(q for q, _ in made if q.startswith("Tell me about"))
    reworded = question.upper().rstrip(".") + "!!"
    with open(copy / "heldout/tune.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"user": reworded, "assistant": "A held-out reply."}) + "\n")
    mod.main()
    users = {mod.key(m["content"]) for d in read_dialogs([str(copy / "tune/chat.jsonl")]) for m in d["messages"]
             if m["role"] == "user"}
    assert mod.key(question) not in users
    assert mod.key(made[0][0]) in users or mod.key(made[0][0]) == mod.key(question)
    with open(copy / "tune/talk.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"user": reworded.lower(), "assistant": "A tune reply."}, ensure_ascii=False) + "\n")
    with pytest.raises(SystemExit, match=r"^error: the held-out dialogs ask a tune question: .*reword one of them$"):
        mod.main()
