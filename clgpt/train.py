"""The training loop shared by the pretrain and tune stages: learning-rate schedule, gradient
accumulation, clipping (in Engine.step), checkpoints, exact resume, a CSV log and a tqdm bar.

Determinism: everything random comes from one `np.random.default_rng(seed)` owned by the batch sampler,
whose state (and, for dialogs, the epoch's permutation and position) goes into every checkpoint. A run
resumed from a checkpoint therefore draws exactly the batches the uninterrupted run would have drawn and
ends with the same weights, bit for bit, on the same device.

Files: while a stage runs, checkpoints go to `ckpt_out + ".partial"`; the finished model is renamed to
`ckpt_out` at the end, so Snakemake never sees a complete-looking output early. A re-run resumes from the
`.partial` when its settings hash (settings, model shape, input data) matches, and starts afresh otherwise.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from tqdm import tqdm

from clgpt.atomic import atomic_path
from clgpt.checkpoint import load_checkpoint, save_checkpoint
from clgpt.data import load_encoded
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig, init_params
from clgpt.precision import PRECISIONS

# Settings of both stages with their defaults (the same as schemas/config.schema.yaml). epochs > 0
# replaces steps by ceil(epochs * rows / rows_per_step); mix_pretrain is the tune stage's share of rows
# that are pretrain windows.
DEFAULTS = {
    "seed": 1234,  # init (pretrain) and data order
    "steps": 300,  # optimizer steps
    "epochs": 0,  # passes over the data; 0 = use steps
    "batch_size": 16,  # rows per micro-batch
    "seq_len": 64,  # tokens per row (pretrain windows; the cap on a dialog's length in tune)
    "lr": 3e-3,  # peak learning rate, reached after warmup
    "min_lr": 3e-4,  # learning rate at the end of the cosine decay
    "warmup_steps": 20,  # linear warmup from lr/warmup_steps to lr
    "weight_decay": 0.1,  # AdamW decoupled decay, matrices only
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,  # global gradient-norm clip; 0 = off
    "precision": "fp32",  # matmul operands: fp32 | tf32 | bf16 | auto (clgpt/precision.py)
    "accum_steps": 1,  # micro-batches per optimizer step
    "checkpoint_every": 50,  # steps between resumable checkpoints
    "target_loss": 0.0,  # stop once the smoothed loss is at or below it; 0 = off
    "mix_pretrain": 0.0,  # tune only: share of rows that are pretrain windows (limits forgetting)
}
STAGES = ("pretrain", "tune")
ADAM_EPS = 1e-8
SMOOTHING = 0.9  # smoothed loss = SMOOTHING * previous + (1 - SMOOTHING) * this step's loss
LOG_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")
# Settings that change how a run is recorded but not the weights it computes: not in the resume hash.
_NOT_HASHED = ("checkpoint_every",)


def stage_settings(stage: str, settings: dict) -> dict:
    """`settings` with defaults filled in and checked; ClgptError naming the key on a bad value."""
    if stage not in STAGES:
        raise ClgptError(f"unknown stage {stage!r}; use one of {', '.join(STAGES)}")
    unknown = sorted(set(settings) - set(DEFAULTS))
    if unknown:
        raise ClgptError(f"{stage}.{unknown[0]}: unknown setting; known: {', '.join(DEFAULTS)}")
    s = {**DEFAULTS, **settings}
    for key in ("seed", "steps", "epochs", "batch_size", "seq_len", "warmup_steps", "accum_steps", "checkpoint_every"):
        if isinstance(s[key], bool) or not isinstance(s[key], (int, np.integer)) or s[key] < 0:
            raise ClgptError(f"{stage}.{key}: expected a non-negative integer, got {s[key]!r}")
        s[key] = int(s[key])
    for key in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip", "target_loss", "mix_pretrain"):
        if isinstance(s[key], bool) or not isinstance(s[key], (int, float)) or not math.isfinite(s[key]) or s[key] < 0:
            raise ClgptError(f"{stage}.{key}: expected a non-negative number, got {s[key]!r}")
        s[key] = float(s[key])
    for key in ("batch_size", "accum_steps", "checkpoint_every"):
        if s[key] < 1:
            raise ClgptError(f"{stage}.{key}: must be at least 1, got {s[key]}")
    if s["precision"] not in PRECISIONS:
        raise ClgptError(f"{stage}.precision: expected one of {', '.join(PRECISIONS)}, got {s['precision']!r}")
    if s["seq_len"] < 2:
        raise ClgptError(f"{stage}.seq_len: must be at least 2, got {s['seq_len']}")
    if s["steps"] < 1 and s["epochs"] < 1:
        raise ClgptError(f"{stage}.steps: must be at least 1 (or set epochs), got {s['steps']}")
    if s["lr"] <= 0:
        raise ClgptError(f"{stage}.lr: must be above 0, got {s['lr']}")
    for key in ("beta1", "beta2"):
        if s[key] >= 1:
            raise ClgptError(f"{stage}.{key}: must be below 1, got {s[key]}")
    if s["mix_pretrain"] >= 1:
        raise ClgptError(f"{stage}.mix_pretrain: must be below 1 (some rows must be dialogs), got {s['mix_pretrain']}")
    if stage == "pretrain" and s["mix_pretrain"] > 0:
        raise ClgptError("pretrain.mix_pretrain: only the tune stage mixes in pretrain text; remove it")
    return s


def lr_at(step: int, total_steps: int, lr: float, min_lr: float, warmup_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup lr*(step+1)/warmup over the first
    warmup_steps, then cosine decay from lr to min_lr, reaching min_lr at the last step."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps - 1
    if decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# ---- batches -----------------------------------------------------------------------------------

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


def dialog_rows(ids, meta: dict, where: str, T: int) -> tuple[list[tuple[np.ndarray, int]], int]:
    """[(dialog ids int32, index of its <assistant> token)] of an encoded dialog file, leaving out the
    dialogs whose reply starts past T tokens (nothing of them would count); -> (rows, number left out)."""
    positions = meta.get("assistant_pos") or []
    if meta.get("kind") != "dialog" or len(positions) != len(meta["documents"]):
        raise ClgptError(f"{where}: not an encoded dialog file (kind {meta.get('kind')!r}); re-run the encode stage")
    rows, dropped = [], 0
    for (start, end), pos in zip(meta["documents"], positions):
        doc = np.asarray(ids[start:end], dtype=np.int32)
        a = pos - start
        if not 0 <= a < len(doc) - 1:
            raise ClgptError(
                f"{where}: assistant_pos {pos} is outside its dialog [{start}, {end}); re-run the encode stage"
            )
        if a >= min(len(doc) - 1, T):
            dropped += 1
        else:
            rows.append((doc, a))
    return rows, dropped


def pad_dialogs(rows: list[tuple[np.ndarray, int]], T: int):
    """One dialog a row, cut to T tokens and padded to the longest row W <= T.
    -> tokens, targets int32 (n, W); mask float32 (n, W), 1 from the <assistant> token's target on
    (the reply and its </s>); number of real tokens. Padding is id 0 with mask 0: causal attention
    keeps it from reaching the real positions before it."""
    width = max(min(len(doc) - 1, T) for doc, _ in rows)
    tokens = np.zeros((len(rows), width), dtype=np.int32)
    targets = np.zeros((len(rows), width), dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    n_real = 0
    for r, (doc, a) in enumerate(rows):
        L = min(len(doc) - 1, T)
        tokens[r, :L], targets[r, :L] = doc[:L], doc[1 : L + 1]
        mask[r, a:L] = 1.0
        n_real += L
    return tokens, targets, mask, n_real


class DialogBatches:
    """Tune micro-batches: B - n_mix dialogs (see pad_dialogs), shuffled once per epoch; rows run on into
    the next epoch's order so every batch is full. With mix_pretrain, n_mix = round(mix * B) more rows
    are pretrain windows as wide as the dialog rows, every target counting."""

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
        self.epoch, self.pos = 0, 0
        self.order = self.rng.permutation(len(self.dialogs))

    def _next_dialog(self) -> tuple[np.ndarray, int]:
        if self.pos == len(self.order):
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = self.rng.permutation(len(self.dialogs))
        doc, a = self.dialogs[self.order[self.pos]]
        self.pos += 1
        return doc, a

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


# ---- files ---------------------------------------------------------------------------------------

def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_log(path: str, up_to_step: int) -> list[dict]:
    """The rows for steps 1..up_to_step of an earlier run's CSV log (later rows were not checkpointed);
    stops at the first row that is not the next step with every column (e.g. one cut by a kill)."""
    if up_to_step <= 0 or not os.path.exists(path):
        return []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError):
        return []
    kept = []
    for row in rows[:up_to_step]:
        if row.get("step") != str(len(kept) + 1) or any(not row.get(c) for c in LOG_COLUMNS):
            break
        kept.append(row)
    return kept


def _start_log(path: str, rows: list[dict]):
    """Rewrite the log (atomically) with the header and the kept rows; return it open for appending."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=LOG_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return open(path, "a", newline="", encoding="utf-8")


def _resolve_device(device):
    if device is None or isinstance(device, str):
        from clgpt.device import get_device

        return get_device(device or None)
    return device


class _DeferSigint:
    """The first Ctrl-C asks the loop to stop after the current step (so the checkpoint is consistent);
    a second one interrupts at once. Only in the main thread, where Python delivers signals."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
        tqdm.write("Ctrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to stop now)",
                   file=sys.stderr)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


# ---- the stage -----------------------------------------------------------------------------------

@dataclass
class _Inputs:
    cfg: ModelConfig
    params: dict[str, np.ndarray]  # the starting weights
    batches: PretrainBatches | DialogBatches
    tokenizer_hash: str | None
    hashes: dict[str, str]  # sha256 of every input file: part of the resume key


@dataclass
class _Progress:
    """What a checkpoint records beyond weights, optimizer and sampler state."""

    step: int = 0  # optimizer steps done
    smoothed_loss: float | None = None
    last_loss: float | None = None
    tokens_seen: int = 0


def _pretrain_inputs(encoded: str, s: dict, model: dict | None, tokenizer_hash: str | None) -> _Inputs:
    ids, meta = load_encoded(encoded)
    if tokenizer_hash and meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tokenizer_hash:
        raise ClgptError(f"{encoded}: encoded with another tokenizer; re-run the encode stage")
    if meta.get("kind", "text") != "text":
        raise ClgptError(f"{encoded}: pretrain needs encoded text, this file holds {meta.get('kind')!r}")
    m = dict(model or {})
    unknown = sorted(set(m) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise ClgptError(f"model.{unknown[0]}: unknown key; known: {', '.join(ModelConfig.__dataclass_fields__)}")
    m["vocab_size"] = m.get("vocab_size") or int(meta["vocab_size"])
    cfg = ModelConfig.from_dict(m)
    cfg.validate()
    if cfg.vocab_size < meta["vocab_size"]:
        raise ClgptError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {meta['vocab_size']}")
    return _Inputs(cfg, init_params(cfg, s["seed"]), PretrainBatches(ids, s, encoded),
                   tokenizer_hash or meta.get("tokenizer_hash"), {"data": _sha256_file(encoded)})


def _tune_inputs(encoded: str, s: dict, init_ckpt: str | None, mix_encoded: str | None) -> _Inputs:
    if init_ckpt is None:
        raise ClgptError("tune needs init_ckpt, the pretrain checkpoint")
    init = load_checkpoint(init_ckpt)
    ids, meta = load_encoded(encoded)
    tok_hash = init["extra"].get("tokenizer_hash") or meta.get("tokenizer_hash")
    if tok_hash and meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tok_hash:
        raise ClgptError(
            f"{encoded}: encoded with another tokenizer than {init_ckpt} was trained with; re-run the encode stage"
        )
    if meta["vocab_size"] > init["cfg"].vocab_size:
        raise ClgptError(
            f"{encoded}: vocabulary of {meta['vocab_size']} is larger than the model's {init['cfg'].vocab_size}"
        )
    hashes = {"data": _sha256_file(encoded), "init": _sha256_file(init_ckpt)}
    mix_ids = None
    if s["mix_pretrain"] > 0:
        if mix_encoded is None:
            raise ClgptError("tune.mix_pretrain is above 0 but no pretrain data (mix_encoded) was given")
        mix_ids, mix_meta = load_encoded(mix_encoded)
        if tok_hash and mix_meta.get("tokenizer_hash") and mix_meta["tokenizer_hash"] != tok_hash:
            raise ClgptError(f"{mix_encoded}: encoded with another tokenizer; re-run the encode stage")
        hashes["mix"] = _sha256_file(mix_encoded)
    batches = DialogBatches(ids, meta, s, encoded, mix_ids, mix_encoded or "")
    return _Inputs(init["cfg"], init["params"], batches, tok_hash, hashes)


def _resume_key(stage: str, s: dict, inp: _Inputs, total: int) -> str:
    """sha256 of everything that decides the weights: a .partial with another key is not resumed."""
    key = {"stage": stage, "cfg": json.loads(inp.cfg.to_json()), "total_steps": total, "inputs": inp.hashes,
           "settings": {k: v for k, v in s.items() if k not in _NOT_HASHED}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _resume(partial: str, key: str, eng, batches, stage: str, total: int) -> _Progress:
    """Load a matching .partial into the engine and the sampler; a fresh _Progress when there is none."""
    if not os.path.exists(partial):
        return _Progress()
    try:
        ck = load_checkpoint(partial)
    except ClgptError as e:
        tqdm.write(f"{stage}: ignoring unreadable {partial} ({e})", file=sys.stderr)
        return _Progress()
    if ck["extra"].get("resume_key") != key:
        tqdm.write(f"{stage}: {partial} is from other settings or data; starting afresh", file=sys.stderr)
        return _Progress()
    eng.set_params(ck["params"])
    eng.set_optimizer_state(ck["opt_state"])
    batches.set_state(ck["rng_state"])
    tqdm.write(f"{stage}: resuming from {partial} at step {ck['step']}/{total}", file=sys.stderr)
    return _Progress(ck["step"], **ck["extra"]["progress"])


def run_stage(
    stage: str,
    encoded: str,
    settings: dict,
    ckpt_out: str,
    log_csv: str,
    *,
    model: dict | None = None,
    init_ckpt: str | None = None,
    mix_encoded: str | None = None,
    device=None,
    tokenizer_hash: str | None = None,
    callback: Callable[[int, float], None] | None = None,
) -> dict:
    """Train one stage and write `ckpt_out` and `log_csv`.

    pretrain: a new model of shape `model` (ModelConfig fields; vocab_size from the data when 0/absent),
    initialised from settings.seed, trained on random windows of `encoded`.
    tune: continues from `init_ckpt` (its shape, never the config's) on the dialogs of `encoded`, loss on
    the replies only; `mix_encoded` supplies pretrain rows when settings.mix_pretrain > 0.
    device: a clgpt.device.Device, or a spec string for clgpt.device.get_device (None = default choice).
    callback(step, loss) runs after every optimizer step (tests use it to interrupt a run).

    Returns {"stage", "steps", "total_steps", "final_loss", "smoothed_loss", "tokens_seen", "seconds",
    "resumed_from", "stopped_early", "dropped_rows"}.
    """
    s = stage_settings(stage, settings)
    if stage == "pretrain":
        if init_ckpt is not None:
            raise ClgptError("pretrain starts from scratch; init_ckpt is for the tune stage")
        inp = _pretrain_inputs(encoded, s, model, tokenizer_hash)
    else:
        if model is not None:
            raise ClgptError("tune takes the model's shape from init_ckpt; do not pass model")
        inp = _tune_inputs(encoded, s, init_ckpt, mix_encoded)
    cfg, batches = inp.cfg, inp.batches
    if s["seq_len"] > cfg.n_ctx:
        raise ClgptError(f"{stage}.seq_len={s['seq_len']} is longer than the model's n_ctx={cfg.n_ctx}")
    if batches.dropped:
        tqdm.write(f"{stage}: {batches.dropped} dialogs have no reply within seq_len={s['seq_len']} tokens; skipped",
                   file=sys.stderr)
    B, T, accum = s["batch_size"], s["seq_len"], s["accum_steps"]
    if s["epochs"] > 0:
        total = max(1, math.ceil(s["epochs"] * batches.rows_per_epoch / ((B - batches.n_mix) * accum)))
    else:
        total = s["steps"]
    key = _resume_key(stage, s, inp, total)

    from clgpt.engine_llama import make_engine  # Engine (gpt2) or LlamaEngine (llama); needs OpenCL

    eng = make_engine(cfg, inp.params, batch_size=B, seq_len=T, device=_resolve_device(device),
                      precision=s["precision"])
    partial = ckpt_out + ".partial"
    prog = _resume(partial, key, eng, batches, stage, total)
    resumed_from = prog.step

    def save(path: str, sampler_state: dict) -> None:
        params = eng.get_params()
        bad = [n for n, w in params.items() if not np.isfinite(w).all()]
        if bad:
            raise ClgptError(
                f"{stage}: weights became non-finite ({bad[0]}) at step {prog.step}; the last good checkpoint "
                f"is kept at {partial}; lower {stage}.lr (now {s['lr']}) or grad_clip"
            )
        extra = {"stage": stage, "settings": s, "resume_key": key, "tokenizer_hash": inp.tokenizer_hash,
                 "total_steps": total, "dropped_rows": batches.dropped,
                 "progress": {k: v for k, v in vars(prog).items() if k != "step"}}
        save_checkpoint(path, cfg, params, eng.get_optimizer_state(), prog.step, sampler_state, extra)

    kept_rows = _read_log(log_csv, prog.step)
    elapsed_before = float(kept_rows[-1]["elapsed_s"]) if kept_rows else 0.0
    log = _start_log(log_csv, kept_rows)
    writer = csv.writer(log)
    bar = tqdm(total=total, initial=prog.step, desc=stage, unit="step", file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    resume_state = batches.state()  # the sampler's state at the start of step prog.step
    in_update, stopped_early = False, False
    try:
        with _DeferSigint() as sigint:
            while prog.step < total:
                t_step = time.perf_counter()
                lr = lr_at(prog.step, total, s["lr"], s["min_lr"], s["warmup_steps"])
                eng.zero_grad()
                loss, n_tokens = 0.0, 0
                for _ in range(accum):
                    tokens, targets, mask, n_real = batches.next()
                    loss += float(eng.forward(tokens, targets, mask)) / accum
                    eng.backward(1.0 / accum)
                    n_tokens += n_real
                if not math.isfinite(loss):
                    kept = (f"the last good checkpoint is kept at {partial}" if os.path.exists(partial)
                            else "no checkpoint was written yet")
                    raise ClgptError(
                        f"{stage}: loss became {loss} at step {prog.step + 1}; {kept}; lower {stage}.lr "
                        f"(now {s['lr']}) or raise warmup_steps"
                    )
                in_update = True
                norm = float(eng.step(lr, s["beta1"], s["beta2"], ADAM_EPS, s["weight_decay"], s["grad_clip"]))
                prog.step += 1
                resume_state = batches.state()
                prog.tokens_seen += n_tokens
                prog.last_loss = loss
                prev = loss if prog.smoothed_loss is None else prog.smoothed_loss
                prog.smoothed_loss = SMOOTHING * prev + (1 - SMOOTHING) * loss
                in_update = False

                now = time.perf_counter()
                tok_s = n_tokens / max(now - t_step, 1e-9)
                writer.writerow([prog.step, f"{loss:.6f}", f"{lr:.6g}", f"{norm:.6g}", f"{tok_s:.1f}",
                                 f"{elapsed_before + now - t0:.3f}"])
                log.flush()
                bar.set_postfix(loss=f"{prog.smoothed_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
                bar.update(1)

                if prog.step % s["checkpoint_every"] == 0 and prog.step < total:
                    save(partial, resume_state)
                if callback is not None:
                    callback(prog.step, loss)
                if sigint.requested:
                    raise KeyboardInterrupt
                if 0 < s["target_loss"] and prog.smoothed_loss <= s["target_loss"]:
                    stopped_early = prog.step < total
                    tqdm.write(f"{stage}: smoothed loss {prog.smoothed_loss:.4f} <= target {s['target_loss']} "
                               f"at step {prog.step}", file=sys.stderr)
                    break
    except KeyboardInterrupt:
        bar.close()
        if in_update:  # a second Ctrl-C inside Engine.step: the weights may be half updated
            tqdm.write(f"{stage}: interrupted while updating the weights; the last checkpoint stays", file=sys.stderr)
        else:
            save(partial, resume_state)
            tqdm.write(f"{stage}: interrupted; saved step {prog.step} to {partial}; run again to resume",
                       file=sys.stderr)
        raise
    finally:
        bar.close()
        log.close()

    save(ckpt_out, resume_state)
    if os.path.exists(partial):
        os.remove(partial)
    return {
        "stage": stage, "steps": prog.step, "total_steps": total, "final_loss": prog.last_loss,
        "smoothed_loss": prog.smoothed_loss, "tokens_seen": prog.tokens_seen, "seconds": time.perf_counter() - t0,
        "resumed_from": resumed_from, "stopped_early": stopped_early, "dropped_rows": batches.dropped,
    }
