"""Byte-level BPE: round trips, specials, agreement with Hugging Face tokenizers, incremental training
against a naive trainer, determinism, the save format and its errors."""

import json
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clgpt.errors import ClgptError
from clgpt.text.bpe import get_stats, merge
from clgpt.text.tokenizer import GPT2_SPLIT_PATTERN, SPECIAL_TOKENS, Tokenizer, bytes_to_unicode, split_words

BASE_TEXT = """\
The quick brown fox jumps over the lazy dog. Don't we'll I'M they're you've she'd it's.
def train(texts, vocab_size):
    for i in range(10):
        print(f"step {i}: loss={0.5 * i:.3f}")  # comment
    return {"merges": [[1, 2], [3, 4]], 'ok': True}
Hello, world! ?!... 1234567890 3.14159 -42 +7 0x1F
Привет, мир! Съешь же ещё этих мягких французских булок.
日本語のテキストと中文文本。한국어 텍스트.
مرحبا بالعالم  שלום עולם
Emoji: 👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 ❤️
\ttabs\tand  runs   of    spaces\r\nwindows line\r\n
"""

EXTRA_WORDS = [" the", " and", " of", "ing", " tokenizer", " model", "GGUF", "OpenCL", " über", " naïve",
               " café", "日本", " мир", " 42", "3.5", "...", "!!", "\n\n", "    ", "\t", " 😀", "'s", "'ll"]


def make_corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = split_words(BASE_TEXT) + EXTRA_WORDS
    lines = [BASE_TEXT]
    for _ in range(n_lines):
        lines.append("".join(rng.choice(words) for _ in range(rng.randint(3, 20))) + "\n")
    return lines


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return make_corpus()


@pytest.fixture(scope="module")
def tok(corpus) -> Tokenizer:
    return Tokenizer.train(corpus, 600)


# ---- layout ---------------------------------------------------------------------------------------


def test_id_layout(tok):
    assert tok.vocab_size == 600
    assert len(tok.merges) == 600 - 256 - len(SPECIAL_TOKENS)
    for i in range(256):
        assert tok.token_bytes(i) == bytes([i])
    for k, (a, b) in enumerate(tok.merges):
        assert a < 256 + k and b < 256 + k
        assert tok.token_bytes(256 + k) == tok.token_bytes(a) + tok.token_bytes(b)
    specials = [tok.bos_id, tok.eos_id, tok.im_start_id, tok.im_end_id]
    assert specials == list(range(600 - 4, 600))
    assert [tok.token_bytes(i).decode() for i in specials] == SPECIAL_TOKENS
    all_bytes = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    assert len(set(all_bytes)) == len(all_bytes)


def test_get_stats_and_merge():
    assert get_stats([1, 2, 1, 2, 2]) == {(1, 2): 2, (2, 1): 1, (2, 2): 1}
    assert get_stats([1, 1, 1], {(1, 1): 5}, weight=3) == {(1, 1): 11}
    assert merge([1, 2, 1, 2, 3], (1, 2), 9) == [9, 9, 3]
    assert merge([1, 1, 1], (1, 1), 9) == [9, 1]  # left to right, no overlap
    assert merge([1, 1, 1, 1], (1, 1), 9) == [9, 9]
    assert merge([5], (1, 2), 9) == [5]


def test_split_words_is_the_gpt2_pattern():
    assert GPT2_SPLIT_PATTERN == r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    words = ["Hello", ",", " world", "!", " ", " don", "'t", " 42", "x", "\n\n"]
    assert split_words("Hello, world!  don't 42x\n\n") == words


# ---- round trips ----------------------------------------------------------------------------------

ROUND_TRIP_CASES = {
    "empty": "",
    "emoji_zwj": "family 👩‍👩‍👧‍👦, flag 🏳️‍🌈, skin 👍🏽, heart ❤️ and 🧑‍💻!",
    "cjk": "日本語のテキストと中文文本，한국어 텍스트。",
    "cyrillic": "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "rtl": "مرحبا بالعالم\u200f שלום עולם \u202bembedded\u202c",
    "crlf": "line one\r\nline two\r\n\r\n",
    "spaces_tabs": "a  b   c\t\td \t \t e         \t",
    "punct": "?!... ;;; --- ((())) ``` ~~~",
    "hello": "Hello, world!",
    "contractions": "don't we'll I'M they're you've she'd it's O'Neil '' 's",
    "trailing": "trailing spaces   \n\n\n   ",
    "leading": "   \n\tleading",
    "control": "\x00\x01\x07\x1b[31mred\x1b[0m\x7f\x85",
    "special_names": "<s><user>hi</s><assistant> <|endoftext|>",
    "combining": "e\u0301 n\u0303 a\u030a\u0323 Z\u0351\u0352\u0353",
    "astral": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 \U0010fffd",
    "numbers": "3.14159 1e-9 0x1F 1_000_000 ٣٤٥ ½ ²",
    "code": 'def f(x):\n    return {"a": [1, 2]}  # ok\n',
}


@pytest.mark.parametrize("text", ROUND_TRIP_CASES.values(), ids=ROUND_TRIP_CASES.keys())
def test_round_trip_cases(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert all(0 <= i < tok.bos_id for i in ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.bos_id for i in ids)


def test_training_text_compresses(tok, corpus):
    text = "".join(corpus)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < 0.5 * len(text.encode("utf-8"))


# ---- special tokens -------------------------------------------------------------------------------


def test_specials_are_never_encoded(tok):
    text = "<s><|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|></s>"
    ids = tok.encode(text)
    for special in (tok.bos_id, tok.eos_id, tok.im_start_id, tok.im_end_id):
        assert special not in ids
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") != [tok.im_start_id]


def test_specials_decode_to_their_names(tok):
    ids = [tok.bos_id, tok.im_start_id] + tok.encode("hi") + [tok.im_end_id] + tok.encode("yo") + [tok.eos_id]
    assert tok.decode(ids) == "<s><|im_start|>hi<|im_end|>yo</s>"


def test_decode_rejects_unknown_ids(tok):
    for bad in (tok.vocab_size, -1):
        with pytest.raises(ClgptError, match=str(bad)):
            tok.decode([1, bad])
    with pytest.raises(ClgptError):
        tok.token_bytes(tok.vocab_size)


def test_decode_invalid_utf8_is_replaced(tok):
    assert tok.decode([0xE2, 0x82]) == "\ufffd"
    assert tok.decode([ord("a"), 0xFF, ord("b")]) == "a\ufffdb"
    assert tok.decode_bytes([0xE2, 0x82, 0xAC]) == "€".encode()


# ---- rank order (what llama.cpp does) -------------------------------------------------------------


def apply_merges_in_training_order(tok, word: str) -> list[int]:
    ids = list(word.encode("utf-8"))
    for k, pair in enumerate(tok.merges):
        ids = merge(ids, pair, 256 + k)
    return ids


def test_rank_order_encoding_equals_training_order(tok, corpus):
    rng = random.Random(1)
    words = sorted(set(split_words("".join(corpus))))
    words += ["".join(rng.choice("ab cde\n'") for _ in range(rng.randint(1, 12))) for _ in range(200)]
    for word in words:
        for piece in split_words(word):
            assert tok.encode(piece) == apply_merges_in_training_order(tok, piece), piece


def hf_tokenizer(tok):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    n_normal = 256 + len(tok.merges)
    vocab = {s: i for i, s in enumerate(tok.gguf_tokens()[:n_normal])}
    merges = [tuple(m.split(" ")) for m in tok.gguf_merges()]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    return hf


def varied_strings(corpus, n: int = 300, seed: int = 2) -> list[str]:
    rng = random.Random(seed)
    words = sorted(set(split_words("".join(corpus))))
    extras = [",", ".", "!?", "...", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "0", "42", "2024",
              "3.14", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "é", "ß", "Ω", "ж", "中", "🙂",
              "👩‍💻", "\u200d", "\x00", "\x1b", "\u0301", "<user>", "</s>"]
    out = list(ROUND_TRIP_CASES.values())
    while len(out) < n:
        pool = words if rng.random() < 0.6 else extras
        out.append("".join(rng.choice(pool if rng.random() < 0.7 else extras) for _ in range(rng.randint(1, 15))))
    return out


def test_same_ids_as_huggingface_bpe(tok, corpus):
    hf = hf_tokenizer(tok)
    strings = varied_strings(corpus)
    assert len(strings) >= 300
    for s in strings:
        ours = tok.encode(s)
        assert ours == hf.encode(s).ids, repr(s)
        assert hf.decode(ours) == s


# ---- training -------------------------------------------------------------------------------------


def naive_train(texts, n_merges):
    """Full recount every step; the most frequent pair wins, ties to the smallest (a, b)."""
    freqs = Counter(w for t in texts for w in split_words(t))
    words = {w: list(w.encode("utf-8")) for w in freqs}
    vocab = [bytes([i]) for i in range(256)]
    merges, banned = [], set()
    while len(merges) < n_merges:
        counts = Counter()
        for w, f in freqs.items():
            ids = words[w]
            for i in range(len(ids) - 1):
                counts[(ids[i], ids[i + 1])] += f
        candidates = [(-c, p) for p, c in counts.items() if p not in banned]
        if not candidates:
            break
        _, (a, b) = min(candidates)
        if vocab[a] + vocab[b] in vocab:
            banned.add((a, b))
            continue
        idx = len(vocab)
        vocab.append(vocab[a] + vocab[b])
        merges.append((a, b))
        for w, ids in words.items():
            out, i = [], 0
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                    out.append(idx)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            words[w] = out
    return merges


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_counts_match_naive_trainer(seed):
    texts = make_corpus(n_lines=60, seed=seed) + ["aaaa aaa aaaaaaa abababab bbbb\n" * 3]
    n_merges = 120
    tok = Tokenizer.train(texts, 256 + n_merges + len(SPECIAL_TOKENS))
    assert tok.merges == naive_train(texts, n_merges)


def test_training_stops_when_no_pairs_are_left():
    tok = Tokenizer.train(["ab ab ab"], 1000)
    assert tok.merges == [(97, 98), (32, 256)]  # "ab", " ab"
    assert tok.vocab_size == 256 + 2 + len(SPECIAL_TOKENS)
    assert tok.bos_id == 258


def test_ties_break_to_smallest_pair():
    # every pair occurs once: (32, 99) " c" < (97, 98) "ab" < (99, 100) "cd"
    tok = Tokenizer.train(["ab cd"], 256 + 3 + len(SPECIAL_TOKENS))
    assert tok.merges == [(32, 99), (97, 98), (256, 100)]
    # higher counts still win over smaller ids
    tok = Tokenizer.train(["ab cd xcd"], 256 + 1 + len(SPECIAL_TOKENS))
    assert tok.merges == [(99, 100)]


def test_training_is_deterministic(corpus):
    a = Tokenizer.train(corpus, 400)
    b = Tokenizer.train(iter(reversed(corpus)), 400)  # word order differs, counts do not
    assert a.hash() == b.hash()
    assert a.merges == b.merges
    assert Tokenizer.train(corpus, 401).hash() != a.hash()


def test_train_accepts_a_single_string_and_a_generator():
    text = "hello hello world\n" * 5
    assert Tokenizer.train(text, 270).merges == Tokenizer.train((line for line in [text]), 270).merges


@pytest.mark.parametrize("vocab_size", [0, 100, 259])
def test_vocab_size_too_small(vocab_size):
    with pytest.raises(ClgptError, match="vocab_size"):
        Tokenizer.train(["some text"], vocab_size)


def test_smallest_vocab_has_no_merges():
    tok = Tokenizer.train(["some text"], 260)
    assert tok.merges == [] and tok.vocab_size == 260
    assert tok.decode(tok.encode("some text")) == "some text"


# ---- files ----------------------------------------------------------------------------------------


def test_save_load_round_trip(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1
    loaded = Tokenizer.load(path)
    assert loaded.merges == tok.merges
    assert loaded.hash() == tok.hash()
    assert loaded.vocab_size == tok.vocab_size
    text = ROUND_TRIP_CASES["emoji_zwj"] + ROUND_TRIP_CASES["code"]
    assert loaded.encode(text) == tok.encode(text)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left


def bad_file(tmp_path, content) -> str:
    path = tmp_path / "tok.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(path)


def valid_dict(tok) -> dict:
    return {"version": 1, "merges": [list(p) for p in tok.merges], "special_tokens": list(SPECIAL_TOKENS)}


@pytest.mark.parametrize("case", [
    "missing", "garbage", "truncated", "not_object", "wrong_version", "version_string", "no_merges",
    "merge_out_of_range", "merge_not_pair", "bool_ids", "wrong_specials", "wrong_hash", "wrong_vocab_size",
    "duplicate_token",
])
def test_load_errors_name_the_file(tok, tmp_path, case):
    good = valid_dict(tok)
    content = {
        "garbage": b"\x89PNG\r\n\x1a\n\x00\xff",
        "truncated": json.dumps(good).encode()[:50],
        "not_object": [1, 2, 3],
        "wrong_version": {**good, "version": 2},
        "version_string": {**good, "version": "1"},
        "no_merges": {k: v for k, v in good.items() if k != "merges"},
        "merge_out_of_range": {**good, "merges": [[97, 98], [256, 300]]},
        "merge_not_pair": {**good, "merges": [[97, 98, 99]]},
        "bool_ids": {**good, "merges": [[True, False]]},
        "wrong_specials": {**good, "special_tokens": ["<s>"]},
        "wrong_hash": {**good, "hash": "0" * 64},
        "wrong_vocab_size": {**good, "vocab_size": 7},
        "duplicate_token": {**good, "merges": [[97, 98], [256, 99], [98, 99], [97, 258]]},
    }.get(case)
    path = str(tmp_path / "nope.json") if case == "missing" else bad_file(tmp_path, content)
    with pytest.raises(ClgptError) as err:
        Tokenizer.load(path)
    assert path in str(err.value)
    assert "\n" not in str(err.value)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=300))
def test_load_fuzz_random_bytes(tmp_path, content):
    path = bad_file(tmp_path, content)
    with pytest.raises(ClgptError, match="tok.json"):
        Tokenizer.load(path)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 600) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(merges=json_values,
       extra=st.dictionaries(st.sampled_from(["version", "vocab_size", "hash", "special_tokens"]), json_values))
def test_load_fuzz_json_structures(tmp_path, merges, extra):
    data = {"version": 1, "merges": merges, "special_tokens": list(SPECIAL_TOKENS), **extra}
    path = bad_file(tmp_path, data)
    try:
        tok = Tokenizer.load(path)
    except ClgptError as e:
        assert "tok.json" in str(e)
    else:
        assert tok.decode(tok.encode("ok")) == "ok"


def test_load_deeply_nested_json(tmp_path):
    path = bad_file(tmp_path, b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ClgptError, match="tok.json"):
        Tokenizer.load(path)


def test_dump_vocab(tok, tmp_path):
    path = tmp_path / "vocab.txt"
    tok.dump_vocab(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == tok.vocab_size
    assert lines[32] == "32\t' '"
    assert lines[10] == "10\t'\\n'"
    a, b = tok.merges[0]
    assert lines[256] == f"256\t{tok.token_bytes(256).decode('utf-8', 'replace')!r}\t{a} {b}"
    assert lines[tok.im_start_id].startswith(f"{tok.im_start_id}\t'<|im_start|>'")


# ---- GGUF views -----------------------------------------------------------------------------------


def test_bytes_to_unicode():
    b2u = bytes_to_unicode()
    assert len(b2u) == 256 and len(set(b2u.values())) == 256
    assert b2u[ord(" ")] == "Ġ" and b2u[ord("\n")] == "Ċ" and b2u[ord("a")] == "a"
    assert all(c.isprintable() and not c.isspace() for c in b2u.values())


def test_gguf_views(tok):
    tokens = tok.gguf_tokens()
    assert len(tokens) == tok.vocab_size == len(tok.gguf_token_types())
    assert len(set(tokens)) == len(tokens)
    assert tokens[32] == "Ġ" and tokens[10] == "Ċ"
    assert tokens[-4:] == SPECIAL_TOKENS
    assert tok.gguf_token_types() == [1] * (tok.vocab_size - 4) + [3] * 4
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    for i, s in enumerate(tokens[: tok.bos_id]):
        assert bytes(u2b[c] for c in s) == tok.token_bytes(i)
    merges = tok.gguf_merges()
    assert len(merges) == len(tok.merges)
    for k, m in enumerate(merges):
        left, right = m.split(" ")
        assert left + right == tokens[256 + k]
