"""The compiled engines behind clgpt.text.tokenizer, held to its rules (its Python code is the reference).

Training runs on rustbpe: it counts the pre-tokens of a buffer of texts in parallel on every core (the
buffer bounds the memory; the counts grow with the distinct words, never with the corpus), then merges
with incremental pair counts from a heap. Its rules are ours: ids 0..255 are the bytes, merge k makes
256 + k, the most frequent pair wins and ties go to the smallest pair of ids (a, b); it is given the
gpt-2 regex. What differs is handled here:
  - it reports each token's bytes, not its pair. The pair of merge k is the rank-order encoding of the
    token's bytes under merges 0..k-1: a merge made in training joins two neighbours of a training word,
    and the merges inside that span never depended on what lies outside it (none ever crossed its ends),
    so encoding the span alone gives the same two parts. Anything else means the engines disagree.
  - it never refuses a pair whose bytes are already a token; the reference does. Both make the same
    merges up to the first such pair, so a repeated token in its output is where they would part: the
    reference trains then.
  - its counts are 32-bit: from 2 GiB of text on, the reference trains.
  - its regex (Rust's) has Unicode tables of its own version: a character whose class (letter, number,
    space, other) may differ between versions splits words differently. Such characters (unassigned in
    Python's unicodedata, or classed otherwise by the regex module) are rare in real text; a text that
    holds one is trained and encoded by the reference (`unstable_text`).

Encoding runs on tiktoken, which merges the neighbours whose joined bytes have the lowest rank. With
every merge realizable as above (checked, `realizable`) and every token's bytes distinct, that is the
rank-order pair encoding: in any state of a word, two neighbours u, v whose bytes join to a token t of
rank below the next pair merge would be a span whose encoding alone is already [t], not [u, v].
"""

from __future__ import annotations

import logging
import re
import sys
import time
import unicodedata
from collections.abc import Iterable, Iterator, Sequence

import regex

from clgpt.text.bpe import encode_ids

I32_SAFE_BYTES = (1 << 31) - 1  # below this many bytes of text every pair count fits in int32
_PROGRESS = re.compile(r"Progress: \d+% \((\d+)/(\d+) merges\)")


_CLASS = regex.compile(r"(\p{L})|(\p{N})|(\s)")
_STABLE: set[str] = {chr(i) for i in range(128)}
_UNSTABLE: set[str] = set()


class _Decline(Exception):
    """Raised inside the text stream to stop rustbpe where the reference must train."""


def _unstable_char(ch: str) -> bool:
    cat = unicodedata.category(ch)
    m = _CLASS.match(ch)
    ours = m.lastindex if m else 0
    theirs = 1 if cat[0] == "L" else 2 if cat[0] == "N" else 3 if ch.isspace() and not "\x1c" <= ch <= "\x1f" else 0
    return cat == "Cn" or ours != theirs


def unstable_text(text: str) -> bool:
    """Whether `text` holds a character the engines' regex may class otherwise than the regex module."""
    if text.isascii():
        return False
    new = set(text) - _STABLE
    if not new:
        return False
    if not new.isdisjoint(_UNSTABLE):
        return True
    for ch in new:
        if _unstable_char(ch):
            _UNSTABLE.add(ch)
            return True
        _STABLE.add(ch)
    return False


def pairs_from_token_bytes(tokens: Sequence[bytes]) -> list[tuple[int, int]] | None:
    """The merges that make tokens[256:], recovered from their bytes (see the module docstring); None
    when a token repeats another's bytes or is not two earlier tokens joined by rank order."""
    if len(set(tokens)) != len(tokens) or any(tokens[i] != bytes([i]) for i in range(256)):
        return None
    ranks: dict[tuple[int, int], int] = {}
    merges = []
    for k, t in enumerate(tokens[256:]):
        parts = encode_ids(list(t), ranks)
        if len(parts) != 2:
            return None
        pair = (parts[0], parts[1])
        ranks[pair] = k
        merges.append(pair)
    return merges


def realizable(merges: Sequence[tuple[int, int]]) -> bool:
    """Whether each merge k is the rank-order encoding of its token's bytes under merges 0..k-1."""
    vocab = [bytes([i]) for i in range(256)]
    for a, b in merges:
        vocab.append(vocab[a] + vocab[b])
    return pairs_from_token_bytes(vocab) == [tuple(m) for m in merges]


def grouped(texts: Iterable[str], group_chars: int) -> Iterator[str]:
    """Texts joined by "\\n" up to about group_chars where that changes no pre-token: after a text that
    ends with a non-space, before one that starts with a non-space or with one space character and then
    a non-space, the gpt-2 regex makes the "\\n" a word of its own and cuts the rest as before, and a
    one-byte word holds no pair to count. Short documents (one a line) then reach the engine in pieces
    large enough to share out among the cores. (str.isspace holds for every \\s character and for a
    few more, which only joins less.)"""
    group: list[str] = []
    size = 0
    for t in texts:
        if not t:
            continue
        starts_ok = not t[0].isspace() or (len(t) > 1 and not t[1].isspace())
        if group and (size + len(t) > group_chars or group[-1][-1].isspace() or not starts_ok):
            yield "\n".join(group)
            group, size = [], 0
        group.append(t)
        size += len(t) + 1
    if group:
        yield "\n".join(group)


class _MergeBar(logging.Handler):
    """rustbpe logs "Progress: p% (k/n merges)"; this turns those lines into a tqdm bar (merges/s).
    It is set up once, at import: the Rust side caches whether a logger is enabled on its first record."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.bar = None

    def emit(self, record: logging.LogRecord) -> None:
        m = _PROGRESS.match(record.getMessage())
        if m and self.bar is not None:
            self.bar.total = int(m.group(2))
            self.bar.update(int(m.group(1)) - self.bar.n)


_BAR = _MergeBar()
_LOG = logging.getLogger("rustbpe")
_LOG.addHandler(_BAR)
_LOG.setLevel(logging.INFO)
_LOG.propagate = False


def train_merges(texts: Iterable[str], n_merges: int, pattern: str, group_chars: int, buffer_chars: int,
                 progress: bool = False) -> list[tuple[int, int]] | None:
    """Merges from rustbpe, or None where the reference must train (see the module docstring).

    Memory: rustbpe holds max(2, buffer_chars // group_chars) texts of about group_chars at a time."""
    import rustbpe
    from tqdm import tqdm

    n_bytes = 0

    def counted(it):
        nonlocal n_bytes
        for t in it:
            n = len(t.encode("utf-8"))
            n_bytes += n
            if n_bytes >= I32_SAFE_BYTES or unstable_text(t):
                raise _Decline
            if read_bar is not None:
                read_bar.update(n)
            yield t

    tty = sys.stderr.isatty()
    read_bar = tqdm(desc="tokenizer: counting", unit="B", unit_scale=True, file=sys.stderr,
                    mininterval=0.5 if tty else 30) if progress else None
    merge_bar = None
    if progress:
        merge_bar = tqdm(desc="tokenizer: merging", total=n_merges, unit="merge", file=sys.stderr,
                         mininterval=0.5 if tty else 30)
        _BAR.bar = merge_bar
    t0 = time.perf_counter()
    try:
        engine = rustbpe.Tokenizer()
        engine.train_from_iterator(counted(grouped(texts, group_chars)), 256 + n_merges,
                                   buffer_size=max(2, buffer_chars // group_chars), pattern=pattern)
    except _Decline:
        return None
    finally:
        if progress:
            _BAR.bar = None
            read_bar.close()
            merge_bar.close()
    if progress:
        print(f"tokenizer: {n_bytes / 1e6:.1f} MB of text, {engine.vocab_size - 256} merges in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    tokens = [bytes(b) for b, _ in sorted(engine.get_mergeable_ranks(), key=lambda r: r[1])]
    return pairs_from_token_bytes(tokens)


def tiktoken_encoding(vocab: Sequence[bytes], pattern: str):
    """A tiktoken Encoding whose ranks are our ids (no special tokens: encode_ordinary only)."""
    import tiktoken

    return tiktoken.Encoding("clgpt", pat_str=pattern, mergeable_ranks={b: i for i, b in enumerate(vocab)},
                             special_tokens={})
