"""Byte-level BPE in the GPT-2 style: train, encode, decode, save/load, vocabulary dump, GGUF views.

Ids: 0..255 are the raw bytes (id i is byte i), 256 + k is the token made by merge k, and the
SPECIAL_TOKENS come last in their listed order. Text is split into words ("pre-tokens") with
llama.cpp's "gpt-2" regex before any merging, so a token never spans two words.

Training counts byte pairs over the unique words weighted by their frequency, and after each merge
updates the counts only for the words that held the merged pair (an index pair -> word ids). The best
pair is picked from a max-heap with lazy deletion: an entry whose count no longer matches the live
count is stale and skipped.

Tie-breaking: among pairs with the same count, the lexicographically smallest pair of ids (a, b) wins.
A pair whose bytes would spell a token that already exists (a+bc when ab+c was merged before) is
never merged, so every token has distinct bytes and GGUF readers, which look tokens up by their text,
see the same vocabulary.

The code here is the reference that defines the merges and the ids (train_reference, encode_reference);
Tokenizer.train and Tokenizer.encode run compiled engines held to it (clgpt.text.bpe_engine: rustbpe trains
on every core in bounded memory, tiktoken encodes), which fall back to it where they could differ.

Encoding applies merges by rank, lowest first, within each word, as GPT-2 and llama.cpp do. Training
applies merges in the same order (each merge only creates pairs that hold its new, higher-ranked
token), so a training word and its encoding agree.
"""

from __future__ import annotations

import codecs
import hashlib
import heapq
import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import regex

from clgpt.atomic import write_text_atomic
from clgpt.errors import ClgptError
from clgpt.text.bpe import encode_ids, merge

# BOS and EOS of plain text, then ChatML's start and end of a message (clgpt.text.chat).
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# llama.cpp's "gpt-2" pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_GPT2), the regex of OpenAI's GPT-2 encoder.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

FORMAT_VERSION = 1

_SPLIT = regex.compile(GPT2_SPLIT_PATTERN)
TRAIN_BUFFER_MB = 64  # text the training engine holds at a time (tokenizer.train_buffer_mb)
TRAIN_GROUP_CHARS = 1 << 18  # short texts are grouped into pieces of about this many characters
_ENCODE_CACHE_MAX = 1 << 20  # words; the cache is cleared when it grows past this


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (space -> 'Ġ', newline -> 'Ċ')."""
    # printable Latin-1 bytes stand for themselves; the rest are shifted to 256.. in byte order
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def split_words(text: str) -> list[str]:
    """The pre-tokens of `text`; they concatenate back to `text`."""
    return _SPLIT.findall(text)


def _count_words(texts: Iterable[str]) -> Counter:
    words: Counter = Counter()
    for text in texts:
        words.update(_SPLIT.findall(text))
    return words


def train_reference(texts: Iterable[str], n_merges: int) -> list[tuple[int, int]]:
    """The readable trainer that defines the merges (see the module docstring); memory grows with the
    number of unique words."""
    counted = _count_words(texts)
    words: list[list[int]] = []
    freqs: list[int] = []
    for word, freq in counted.items():
        ids = list(word.encode("utf-8"))
        if len(ids) > 1:  # a single byte has no pairs
            words.append(ids)
            freqs.append(freq)
    del counted

    stats: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # may hold words that lost the pair
    for w, (ids, freq) in enumerate(zip(words, freqs)):
        for pair in zip(ids, ids[1:]):
            stats[pair] += freq
            where[pair].add(w)
    heap = [(-count, pair) for pair, count in stats.items()]
    heapq.heapify(heap)

    vocab_bytes = {bytes([i]) for i in range(256)}
    token_bytes = [bytes([i]) for i in range(256)]
    merges: list[tuple[int, int]] = []
    banned: set[tuple[int, int]] = set()
    while len(merges) < n_merges and heap:
        neg, pair = heapq.heappop(heap)
        if stats.get(pair, 0) != -neg or pair in banned:
            continue  # stale entry
        new_bytes = token_bytes[pair[0]] + token_bytes[pair[1]]
        if new_bytes in vocab_bytes:
            # its bytes are already a token (not seen in practice; HF's trainer guards this too)
            banned.add(pair)
            continue
        idx = 256 + len(merges)
        merges.append(pair)
        token_bytes.append(new_bytes)
        vocab_bytes.add(new_bytes)

        changed: set[tuple[int, int]] = set()
        for w in where.pop(pair):
            old = words[w]
            new = merge(old, pair, idx)
            if len(new) == len(old):
                continue  # the word lost the pair to an earlier merge
            freq = freqs[w]
            for p in zip(old, old[1:]):
                stats[p] -= freq
                changed.add(p)
            for p in zip(new, new[1:]):
                stats[p] += freq
                changed.add(p)
                if idx in p:
                    where[p].add(w)
            words[w] = new
        stats.pop(pair, None)
        changed.discard(pair)
        for p in changed:
            count = stats[p]
            if count > 0:
                if p not in banned:
                    heapq.heappush(heap, (-count, p))
            else:
                del stats[p]
    return merges



class Tokenizer:
    """A trained byte-level BPE: `merges[k] = (a, b)` makes token 256 + k from tokens a and b."""

    def __init__(self, merges: Iterable[tuple[int, int]]):
        self.merges: list[tuple[int, int]] = [(int(a), int(b)) for a, b in merges]
        self._vocab: list[bytes] = [bytes([i]) for i in range(256)]
        for k, (a, b) in enumerate(self.merges):
            n = 256 + k
            if not (0 <= a < n and 0 <= b < n):
                raise ValueError(f"merge {k} ({a}, {b}) uses a token that does not exist before id {n}")
            self._vocab.append(self._vocab[a] + self._vocab[b])
        if len(set(self._vocab)) != len(self._vocab):
            raise ValueError("two merges make tokens with the same bytes")
        self._vocab += [s.encode("utf-8") for s in SPECIAL_TOKENS]
        self._ranks = {pair: k for k, pair in enumerate(self.merges)}
        self._cache: dict[str, list[int]] = {}
        self._fast = None  # the tiktoken Encoding, built on first use; False where it would differ
        n_normal = 256 + len(self.merges)
        self.bos_id, self.eos_id, self.im_start_id, self.im_end_id = range(n_normal, n_normal + len(SPECIAL_TOKENS))

    # ---- training -------------------------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, engine: str = "rustbpe",
              buffer_mb: int = TRAIN_BUFFER_MB, progress: bool = False) -> Tokenizer:
        """Learn merges until 256 bytes + merges + the specials make `vocab_size` tokens.

        Stops early (a smaller vocabulary) when no pair occurs any more. `texts` (strings, or a function
        returning them afresh, which lets the reference re-read them) is streamed. engine
        "rustbpe" (clgpt.text.bpe_engine: every core, memory bounded by `buffer_mb` of text plus the distinct
        words) makes the same merges as "reference" (train_reference, below), which it falls back to
        where it cannot vouch for that. `progress` shows bars on stderr (merges/s).
        """
        n_min = 256 + len(SPECIAL_TOKENS)
        if not isinstance(vocab_size, int) or vocab_size < n_min:
            raise ClgptError(f"vocab_size must be an integer >= {n_min} "
                             f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}")
        if engine not in ("rustbpe", "reference"):
            raise ClgptError(f"tokenizer engine {engine!r}: use rustbpe or reference")
        if isinstance(texts, str):
            texts = [texts]
        fresh = texts if callable(texts) else (lambda: texts)
        n_merges = vocab_size - n_min
        if n_merges == 0:
            return cls([])
        if engine == "rustbpe":
            from clgpt.text.bpe_engine import train_merges

            merges = train_merges(fresh(), n_merges, GPT2_SPLIT_PATTERN, group_chars=TRAIN_GROUP_CHARS,
                                  buffer_chars=buffer_mb << 20, progress=progress)
            if merges is not None:
                return cls(merges)
            if not callable(texts) and iter(texts) is texts:
                raise ClgptError("the rustbpe engine cannot vouch for this corpus's merges and the text was a "
                                 "one-shot iterator; pass a list or a function that yields the texts again")
            print("tokenizer: the reference trainer takes over (see clgpt.text.bpe_engine)", file=sys.stderr)
        return cls(train_reference(fresh(), n_merges))

    # ---- encoding -------------------------------------------------------------------------------

    def _encode_word(self, word: str) -> list[int]:
        return encode_ids(list(word.encode("utf-8")), self._ranks)

    def encode(self, text: str) -> list[int]:
        """Ids of ordinary text; special-token names typed in `text` stay plain characters.

        tiktoken encodes (clgpt.text.bpe_engine says why its ids are encode_reference's), unless a merge
        list made by hand breaks the condition that guarantees it or the text holds a character whose
        Unicode class the two regex engines may disagree on."""
        from clgpt.text.bpe_engine import realizable, tiktoken_encoding, unstable_text

        if self._fast is None:
            normal = self._vocab[: 256 + len(self.merges)]
            self._fast = tiktoken_encoding(normal, GPT2_SPLIT_PATTERN) if realizable(self.merges) else False
        if self._fast and not unstable_text(text):
            return self._fast.encode_ordinary(text)
        return self.encode_reference(text)

    def encode_reference(self, text: str) -> list[int]:
        """encode by the readable rules: each pre-token's merges by rank, lowest first."""
        cache = self._cache
        if len(cache) > _ENCODE_CACHE_MAX:
            cache.clear()
        out: list[int] = []
        for word in _SPLIT.findall(text):
            ids = cache.get(word)
            if ids is None:
                ids = cache[word] = self._encode_word(word)
            out.extend(ids)
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = list(ids)
        n = len(self._vocab)
        if ids and not (0 <= min(ids) and max(ids) < n):
            bad = next(i for i in ids if not 0 <= i < n)
            raise ClgptError(f"token id {bad!r} is not in the vocabulary (0..{n - 1})")
        return b"".join([self._vocab[i] for i in ids])

    def decode(self, ids: Iterable[int], final: bool = True) -> str:
        """The text of `ids`; bytes that are not UTF-8 read as U+FFFD. final=False: the ids may stop inside a
        character (generation cut by its token limit), whose first bytes are then left out, not shown as U+FFFD."""
        data = self.decode_bytes(ids)
        if final:
            return data.decode("utf-8", errors="replace")
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)

    def token_bytes(self, i: int) -> bytes:
        if not 0 <= i < len(self._vocab):
            raise ClgptError(f"token id {i!r} is not in the vocabulary (0..{len(self._vocab) - 1})")
        return self._vocab[i]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def special_ids(self) -> dict[str, int]:
        return {s: self.bos_id + k for k, s in enumerate(SPECIAL_TOKENS)}

    # ---- files ----------------------------------------------------------------------------------

    def _content(self) -> dict:
        return {"merges": [list(p) for p in self.merges], "special_tokens": list(SPECIAL_TOKENS)}

    def hash(self) -> str:
        """sha256 of the canonical JSON of the merges and the special tokens."""
        canon = json.dumps(self._content(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        data = {"version": FORMAT_VERSION, "type": "byte-level-bpe", "split_pattern": GPT2_SPLIT_PATTERN,
                "vocab_size": self.vocab_size, "hash": self.hash(), **self._content()}
        write_text_atomic(path, json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        def fail(why: str) -> ClgptError:
            return ClgptError(f"{os.fspath(path)}: {why}")

        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise fail(f"cannot read tokenizer file ({e.strerror or e}); run the train_tokenizer stage") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise fail(f"not a tokenizer JSON file ({type(e).__name__})") from None
        if not isinstance(data, dict):
            raise fail("not a tokenizer JSON file (top level is not an object)")
        if data.get("version") != FORMAT_VERSION or type(data.get("version")) is not int:
            raise fail(f"tokenizer format version {data.get('version')!r} is not {FORMAT_VERSION}; "
                       "retrain the tokenizer")
        if data.get("split_pattern", GPT2_SPLIT_PATTERN) != GPT2_SPLIT_PATTERN:
            raise fail("split_pattern differs from the gpt-2 pattern this version uses")
        if data.get("special_tokens") != SPECIAL_TOKENS:
            raise fail(f"special_tokens are {data.get('special_tokens')!r}, this clgpt needs {SPECIAL_TOKENS} "
                       "(the ChatML chat format); retrain the tokenizer")
        merges = data.get("merges")
        if not isinstance(merges, list) or not all(
            isinstance(m, list) and len(m) == 2 and all(type(x) is int for x in m) for m in merges
        ):
            raise fail("merges must be a list of [int, int] pairs")
        try:
            tok = cls(merges)
        except ValueError as e:
            raise fail(f"inconsistent merges: {e}") from None
        if "vocab_size" in data and data["vocab_size"] != tok.vocab_size:
            raise fail(f"vocab_size {data['vocab_size']!r} does not match the {tok.vocab_size} tokens the merges make")
        if "hash" in data and data["hash"] != tok.hash():
            raise fail("hash does not match the merges (file edited or corrupted)")
        return tok

    def dump_vocab(self, path: str | os.PathLike) -> None:
        """One line per id: id, repr of the token's text (bad UTF-8 as U+FFFD), and a merge's two parents."""
        lines = []
        for i, b in enumerate(self._vocab):
            line = f"{i}\t{b.decode('utf-8', errors='replace')!r}"
            if 256 <= i < 256 + len(self.merges):
                a, c = self.merges[i - 256]
                line += f"\t{a} {c}"
            elif i >= 256:
                line += "\tspecial"
            lines.append(line)
        write_text_atomic(path, "\n".join(lines) + "\n")

    # ---- GGUF views -----------------------------------------------------------------------------

    def gguf_tokens(self) -> list[str]:
        """Token texts in GPT-2's bytes-to-unicode spelling; specials as their plain names."""
        b2u = bytes_to_unicode()
        normal = ["".join(b2u[x] for x in b) for b in self._vocab[: 256 + len(self.merges)]]
        return normal + list(SPECIAL_TOKENS)

    def gguf_token_types(self) -> list[int]:
        """1 normal, 3 control (the specials)."""
        return [1] * (256 + len(self.merges)) + [3] * len(SPECIAL_TOKENS)

    def gguf_merges(self) -> list[str]:
        """"left right" in gguf_tokens() spelling, in merge order."""
        toks = self.gguf_tokens()
        return [f"{toks[a]} {toks[b]}" for a, b in self.merges]


