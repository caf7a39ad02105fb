"""Batches: random pretrain windows, dialog rows padded to a few widths (with a share of pretrain windows mixed
in), and the held-out loss's batches of text windows and dialogs.
"""

from __future__ import annotations

import numpy as np

from clgpt.data.encode import load_documents
from clgpt.errors import ClgptError

# ---- batches: training ---------------------------------------------------------------------------

class WindowSampler:
    """Random windows of a flat token stream: a row is w[:-1] -> w[1:] for a window w of T+1 tokens."""

    def __init__(self, ids: np.ndarray, rng: np.random.Generator, where: str):
        self.ids, self.rng, self.where = ids, rng, where

    def rows(self, n: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """-> tokens, targets, int32 (n, T)."""
        if len(self.ids) < T + 1:
            raise ClgptError(
                f"{self.where}: only {len(self.ids)} tokens, fewer than seq_len+1={T + 1}; "
                "add text or lower seq_len"
            )
        starts = self.rng.integers(0, len(self.ids) - T, size=n)  # window = ids[s : s+T+1]
        windows = np.stack([np.asarray(self.ids[s : s + T + 1], dtype=np.int32) for s in starts])
        return windows[:, :-1], windows[:, 1:]


class PretrainBatches:
    """Pretrain micro-batches: B random windows of seq_len+1 tokens, every target counts."""

    def __init__(self, ids, settings: dict, where: str):
        self.rng = np.random.default_rng(settings["seed"])
        self.windows = WindowSampler(ids, self.rng, where)
        self.B, self.T = settings["batch_size"], settings["seq_len"]
        self.rows_per_epoch = max(1, len(ids) // self.T)  # epochs: windows that would tile the stream once
        self.n_mix = self.dropped = 0

    def next(self):
        """-> tokens, targets int32 (B, T), mask float32 (B, T), number of real (unpadded) tokens."""
        tokens, targets = self.windows.rows(self.B, self.T)
        return tokens, targets, np.ones(tokens.shape, dtype=np.float32), tokens.size

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]


def dialog_rows(ids, meta: dict, where: str, T: int) -> tuple[list[tuple[np.ndarray, list]], int]:
    """[(dialog ids int32, its loss spans [(a, b)]: targets a..b-1 count)] of an encoded dialog file, leaving
    out the dialogs whose first reply starts past T tokens (nothing of them would count); -> (rows, number
    left out)."""
    if meta.get("kind") != "dialog":
        raise ClgptError(f"{where}: not an encoded dialog file (kind {meta.get('kind')!r}); re-run the encode stage")
    bounds, _ = load_documents(where, meta)
    spans_of = meta.get("loss_spans")
    if not isinstance(spans_of, list) or len(spans_of) != len(bounds) - 1:
        raise ClgptError(f"{where}: not an encoded dialog file (no loss spans); re-run the encode stage")
    rows, dropped = [], 0
    for start, end, spans in zip(bounds[:-1], bounds[1:], spans_of):
        doc = np.asarray(ids[start:end], dtype=np.int32)
        if not spans or any(not 0 <= a < b <= len(doc) - 1 for a, b in spans):
            raise ClgptError(f"{where}: loss spans {spans} do not fit their dialog [{start}, {end}); re-run the encode stage")
        if spans[0][0] >= min(len(doc) - 1, T):
            dropped += 1
        else:
            rows.append((doc, [tuple(span) for span in spans]))
    return rows, dropped


PAD_WIDTH = 32  # dialog batches are padded to a multiple of this: few distinct widths, few kernel builds


def pad_dialogs(rows: list[tuple[np.ndarray, list]], T: int):
    """One dialog a row, cut to T tokens and padded to W: the longest row rounded up to a multiple of
    PAD_WIDTH, at most T (on PoCL each new width costs kernel builds).
    -> tokens, targets int32 (n, W); mask float32 (n, W), 1 on the targets of the row's loss spans (every
    assistant reply and its end-of-turn token; an int a instead of spans: targets a to the end); number of
    real tokens. Padding is id 0 with mask 0: causal attention keeps it from reaching the real positions
    before it."""
    width = min(-(-max(len(doc) - 1 for doc, _ in rows) // PAD_WIDTH) * PAD_WIDTH, T)
    tokens = np.zeros((len(rows), width), dtype=np.int32)
    targets = np.zeros((len(rows), width), dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    n_real = 0
    for r, (doc, spans) in enumerate(rows):
        L = min(len(doc) - 1, T)
        tokens[r, :L], targets[r, :L] = doc[:L], doc[1 : L + 1]
        for a, b in [(spans, L)] if isinstance(spans, (int, np.integer)) else spans:
            mask[r, a : min(b, L)] = 1.0
        n_real += L
    return tokens, targets, mask, n_real


class DialogBatches:
    """Tune micro-batches: B - n_mix dialogs (see pad_dialogs), shuffled once per epoch; rows run on into
    the next epoch's order so every batch is full. With mix_pretrain, n_mix = round(mix * B) more rows
    are pretrain windows as wide as the dialog rows, every target counting.

    With bucket K > 0, each run of K batches' worth of the shuffled dialogs is sorted by length, cut into
    batches and those batches shuffled: a batch is padded to its own longest row, so one long conversation
    among short questions no longer widens the whole batch (on the default tune data K 8 pads to about 116
    tokens a row on average where random batches pad to 190)."""

    def __init__(self, ids, meta: dict, settings: dict, where: str, mix_ids=None, mix_where: str = ""):
        self.rng = np.random.default_rng(settings["seed"])
        self.B, self.T = settings["batch_size"], settings["seq_len"]
        self.n_mix = min(self.B - 1, int(round(settings["mix_pretrain"] * self.B)))
        if self.n_mix and mix_ids is None:
            raise ClgptError("tune.mix_pretrain is above 0 but no pretrain data (mix_encoded) was given")
        self.mix = WindowSampler(mix_ids, self.rng, mix_where) if self.n_mix else None
        self.dialogs, self.dropped = dialog_rows(ids, meta, where, self.T)
        if not self.dialogs:
            raise ClgptError(f"{where}: no dialog has its reply within seq_len={self.T} tokens; raise tune.seq_len")
        self.rows_per_epoch = len(self.dialogs)
        self.bucket = settings.get("bucket", 0)
        self.lengths = np.array([min(len(doc) - 1, self.T) for doc, _ in self.dialogs], dtype=np.int64)
        self.epoch, self.pos = 0, 0
        self.order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        """This epoch's order of the dialogs: a permutation, length-bucketed when bucket > 0."""
        perm = self.rng.permutation(len(self.dialogs))
        if not self.bucket:
            return perm
        n = self.B - self.n_mix
        head = (-self.epoch * len(perm)) % n  # rows that complete the batch the last epoch began
        groups = [perm[:head]]
        for c in range(head, len(perm), self.bucket * n):
            chunk = perm[c : c + self.bucket * n]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            full = [chunk[g : g + n] for g in range(0, len(chunk) - n + 1, n)]
            groups += [full[i] for i in self.rng.permutation(len(full))]
            groups.append(chunk[len(full) * n :])  # the epoch's last rows, which the next epoch's head completes
        return np.concatenate(groups)

    def _next_dialog(self) -> tuple[np.ndarray, list]:
        if self.pos == len(self.order):
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = self._epoch_order()
        row = self.dialogs[self.order[self.pos]]
        self.pos += 1
        return row

    def next(self):
        """-> tokens, targets int32 (B, W), mask float32 (B, W), number of real tokens; W <= seq_len."""
        tokens, targets, mask, n_real = pad_dialogs([self._next_dialog() for _ in range(self.B - self.n_mix)], self.T)
        if self.n_mix:
            width = tokens.shape[1]
            mix_tokens, mix_targets = self.mix.rows(self.n_mix, width)
            tokens, targets = np.concatenate([tokens, mix_tokens]), np.concatenate([targets, mix_targets])
            mask = np.concatenate([mask, np.ones(mix_tokens.shape, dtype=np.float32)])
            n_real += mix_tokens.size
        return tokens, targets, mask, n_real

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "epoch": self.epoch, "pos": self.pos, "order": self.order}

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.order = np.asarray(state["order"], dtype=np.int64)


# ---- batches: held-out loss ----------------------------------------------------------------------

def text_batches(ids: np.ndarray, T: int, B: int, max_tokens: int = 0):
    """Consecutive windows covering the stream once: rows of T tokens predicting the next T, batched
    by B; a last shorter window for the remainder. With max_tokens > 0, only ceil(max_tokens / T)
    windows, evenly spaced over the stream. Yields tokens, targets int32 (B', T'), mask."""
    n_windows = (len(ids) - 1) // T
    if max_tokens > 0 and -(-max_tokens // T) < n_windows:
        chosen = np.unique(np.linspace(0, n_windows - 1, -(-max_tokens // T)).round().astype(np.int64))
        rest = 0
    else:
        chosen = np.arange(n_windows)
        rest = len(ids) - 1 - n_windows * T
    for b0 in range(0, len(chosen), B):
        rows = np.stack([np.asarray(ids[w * T : w * T + T + 1], dtype=np.int32) for w in chosen[b0 : b0 + B]])
        yield rows[:, :-1], rows[:, 1:], np.ones((len(rows), T), dtype=np.float32)
    if rest > 0:
        row = np.asarray(ids[n_windows * T :], dtype=np.int32)[None, :]
        yield row[:, :-1], row[:, 1:], np.ones((1, rest), dtype=np.float32)


def dialog_batches(rows: list, T: int, B: int):
    for b0 in range(0, len(rows), B):
        tokens, targets, mask, _ = pad_dialogs(rows[b0 : b0 + B], T)
        yield tokens, targets, mask
