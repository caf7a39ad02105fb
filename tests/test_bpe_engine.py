"""The compiled engines (clgpt.text.bpe_engine) against the readable reference in clgpt.text.tokenizer: the same
merges from rustbpe on varied corpora, the same ids from tiktoken, and the fallbacks."""

import random
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

import clgpt.text.bpe_engine as engine
from clgpt.errors import ClgptError
from clgpt.text.tokenizer import SPECIAL_TOKENS, Tokenizer, split_words, train_reference
from test_tokenizer import ROUND_TRIP_CASES, make_corpus, varied_strings

N_SPECIAL = len(SPECIAL_TOKENS)


def unicode_corpus(step: int = 7, unstable: bool = False) -> list[str]:
    """Every step-th code point (no surrogates) in several contexts: after a letter, a digit, a space, a
    newline and itself, so each class of the regex (letters, numbers, spaces, the rest) meets the others.
    Only the characters whose class all Unicode versions agree on, or (unstable) only the others."""
    chars = [chr(c) for c in range(1, 0x110000, step)
             if not 0xD800 <= c < 0xE000 and engine.unstable_text(chr(c)) == unstable]
    lines = []
    for k in range(0, len(chars), 64):
        block = chars[k:k + 64]
        lines.append("".join(f"a{c}1{c} {c}{c}\n{c}'s" for c in block))
        lines.append(" ".join(block) + "  \t" + "".join(block) + "\n\n")
    return lines


def stdlib_text(max_bytes: int) -> list[str]:
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
        if total >= max_bytes:
            break
    return texts


def short_documents(seed: int) -> list[str]:
    """One a line, as corpus.document: line gives them; some start or end with spaces (not joinable)."""
    rng = random.Random(seed)
    words = split_words("".join(make_corpus(40, seed)))
    docs = []
    for _ in range(3000):
        doc = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        docs.append(rng.choice(["", " ", "  ", "\t"]) + doc if rng.random() < 0.2 else doc)
    return docs


CORPORA = {
    "mixed_0": (lambda: make_corpus(400, 0), 700),
    "mixed_1": (lambda: make_corpus(300, 1), 1000),
    "repeats": (lambda: ["aaaa aaa aaaaaaa abababab bbbb\n" * 3, "aaaaaaaaaaaaa bbbbbbbbbbb ababa\n"], 300),
    "unicode": (unicode_corpus, 3000),
    "unstable_unicode": (lambda: unicode_corpus(step=97, unstable=True) + make_corpus(100, 7), 1500),
    "short_documents": (lambda: short_documents(3), 900),
    "stdlib": (lambda: stdlib_text(1_500_000), 2048),
    "runs_out_of_pairs": (lambda: ["ab ab ab"], 1000),
}


@pytest.mark.parametrize("name", CORPORA)
def test_rustbpe_makes_the_reference_merges(name, capsys):
    make, vocab_size = CORPORA[name]
    texts = make()
    fast = Tokenizer.train(texts, vocab_size)
    assert fast.merges == train_reference(texts, vocab_size - 256 - N_SPECIAL)
    assert len(fast.merges) > 0
    # rustbpe made them, except where a character's class depends on the Unicode version
    assert ("reference trainer takes over" in capsys.readouterr().err) == (name == "unstable_unicode")


def test_default_vocabulary_of_the_embedded_corpus_is_unchanged():
    """The pipeline's tokenizer on data/ (corpus.document: line, vocab 1024): the reference's merges."""
    from clgpt.data import dialog_texts, read_dialogs, text_segments

    root = Path(__file__).resolve().parents[1] / "data"
    pretrain = sorted(str(p) for p in (root / "pretrain").glob("*.txt"))
    tune = sorted(str(p) for p in (root / "tune").glob("*.jsonl"))

    def texts():
        yield from (seg for seg, _ in text_segments(pretrain, "line", None))
        yield from dialog_texts(read_dialogs(tune))

    tok = Tokenizer.train(texts, 1024)
    assert tok.merges == train_reference(texts(), 1024 - 256 - N_SPECIAL)
    assert tok.vocab_size == 1024


def test_grouping_moves_no_pretoken():
    docs = short_documents(5) + ["x", " lead", "trail ", "\n", "a\n", "\nb", "'s", "'s'", "1", "2"]
    random.Random(0).shuffle(docs)
    groups = list(engine.grouped(docs, 500))
    assert len(groups) < len(docs) / 2  # short documents were joined (many here end in spaces)
    assert all(len(g) <= 500 + 100 for g in groups)

    def multibyte_words(texts):  # one-byte words hold no pair
        return Counter(w for t in texts for w in split_words(t) if len(w.encode("utf-8")) > 1)

    assert multibyte_words(groups) == multibyte_words(docs)
    n_docs = sum(1 for d in docs if d)
    assert sum(map(len, groups)) == sum(map(len, docs)) + n_docs - len(groups)  # only the "\n" joins added


def test_merge_pairs_are_recovered_from_token_bytes():
    tok = Tokenizer.train(make_corpus(200, 4), 800, engine="reference")
    tokens = [tok.token_bytes(i) for i in range(256 + len(tok.merges))]
    assert engine.pairs_from_token_bytes(tokens) == tok.merges
    assert engine.pairs_from_token_bytes(tokens + [tokens[300]]) is None  # a repeated token
    assert engine.pairs_from_token_bytes(tokens + [b"\x00\x01\x02"]) is None  # not two tokens joined


@pytest.mark.parametrize("cause", ["engine_declines", "two_gib"])
def test_reference_takes_over_where_the_engine_cannot_vouch(monkeypatch, capsys, cause):
    texts = make_corpus(100, 6)
    if cause == "engine_declines":  # as it does when a token repeats another's bytes
        monkeypatch.setattr(engine, "pairs_from_token_bytes", lambda tokens: None)
    else:
        monkeypatch.setattr(engine, "I32_SAFE_BYTES", 1000)
    want = train_reference(texts, 300)
    assert Tokenizer.train(texts, 256 + 300 + N_SPECIAL).merges == want
    assert Tokenizer.train(lambda: iter(texts), 256 + 300 + N_SPECIAL).merges == want
    assert "reference trainer takes over" in capsys.readouterr().err
    with pytest.raises(ClgptError, match="one-shot iterator"):
        Tokenizer.train(iter(texts), 256 + 300 + N_SPECIAL)


def test_progress_bar_shows_merges_per_second(capsys):
    Tokenizer.train(stdlib_text(300_000), 1200, progress=True)
    err = capsys.readouterr().err
    assert "tokenizer: merging" in err and "merge/s" in err
    assert f"{1200 - 256 - N_SPECIAL}/{1200 - 256 - N_SPECIAL}" in err


# ---- encoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixed_0", "unicode", "unstable_unicode", "stdlib"])
def test_tiktoken_ids_are_the_reference_ids(name):
    make, vocab_size = CORPORA[name]
    texts = make()
    tok = Tokenizer.train(texts, vocab_size)
    assert tok.encode("warm up") and tok._fast  # the fast engine is the one in use
    held_out = varied_strings(make_corpus(50, 9), n=400, seed=11) + list(ROUND_TRIP_CASES.values())
    held_out += unicode_corpus(step=5)[::3] + unicode_corpus(step=31, unstable=True)[::2] + stdlib_text(300_000)[-3:]
    for text in texts[:200] + held_out:
        assert tok.encode(text) == tok.encode_reference(text), repr(text[:80])


def test_hand_made_merges_that_tiktoken_would_merge_otherwise_use_the_reference():
    # "abc" is (ab, c), but rank order turns "abc" into [a, bc] before "ab" exists: byte-rank merging
    # (tiktoken) would still join a + bc into "abc", pair-rank merging (llama.cpp, ours) does not
    tok = Tokenizer([(98, 99), (97, 98), (257, 99)])
    assert tok.encode("abc") == [97, 256] == tok.encode_reference("abc")
    assert tok._fast is False
    assert not engine.realizable(tok.merges)
    assert engine.realizable([(98, 99), (97, 256)])
