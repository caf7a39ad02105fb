"""The BPE primitives, as minbpe's base: count adjacent pairs, merge one pair, encode by merge rank.

The tokenizer's reference rules (clgpt.text.tokenizer) and the compiled engines' checks (clgpt.text.bpe_engine)
both build on these; keeping them here lets each import them without importing the other.
"""

from __future__ import annotations

from collections.abc import Sequence


def get_stats(ids: Sequence[int], counts: dict | None = None, weight: int = 1) -> dict[tuple[int, int], int]:
    """Add `weight` to counts[pair] for every adjacent pair in `ids` (overlapping pairs all count)."""
    counts = {} if counts is None else counts
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + weight
    return counts


def encode_ids(ids: list[int], ranks: dict[tuple[int, int], int]) -> list[int]:
    """`ids` (bytes or tokens) with the lowest-ranked adjacent pair merged first, again and again; ranks: pair ->
    merge index k, the merged token being 256 + k."""
    while len(ids) >= 2:
        best, best_rank = None, None
        for pair in zip(ids, ids[1:]):
            rank = ranks.get(pair)
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = pair, rank
        if best is None:
            break
        ids = merge(ids, best, 256 + best_rank)
    return ids


def merge(ids: Sequence[int], pair: tuple[int, int], idx: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids`, left to right, with the token `idx`."""
    a, b = pair
    out = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == a and i + 1 < n and ids[i + 1] == b:
            out.append(idx)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
