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
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from tqdm import tqdm

from clgpt import signals
from clgpt.atomic import atomic_path
from clgpt.config import section_settings
from clgpt.device.knobs import Knobs
from clgpt.device.knobs import read as read_knobs  # once, at the stage's edge
from clgpt.io.checkpoint import load_checkpoint, save_checkpoint
from clgpt.data import (  # noqa: F401  (batching lives in clgpt.data; the names stay importable here)
    DialogBatches,
    PretrainBatches,
    WindowSampler,
    dialog_batches,
    dialog_rows,
    load_encoded,
    pad_dialogs,
    text_batches,
)
from clgpt.errors import ClgptError
from clgpt.device.peaks import peak_flops
from clgpt.device.precision import auto_reason
from clgpt.model import ModelConfig, flops_per_token
from clgpt.models.lora import lora_spec
from clgpt.models.lora_engine import LoraEngine
from clgpt.training.train_inputs import _Inputs, _pretrain_inputs, _sha256_file, _tune_inputs
from clgpt.training.tuned import tuned_knobs

# Settings and their defaults: schemas/config.schema.yaml (clgpt.config.section_settings). epochs > 0
# replaces steps by ceil(epochs * rows / rows_per_step); mix_pretrain is the tune stage's share of rows
# that are pretrain windows.
STAGES = ("pretrain", "tune")
ADAM_EPS = 1e-8
SMOOTHING = 0.9  # smoothed loss = SMOOTHING * previous + (1 - SMOOTHING) * this step's loss
LOG_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s", "val_loss")
_OPTIONAL_COLUMNS = ("val_loss", "mfu")  # empty on steps without an evaluation; on devices without a known peak
# Settings that change how a run is recorded but not the weights it computes: not in the resume hash.
# ranks: the sampler, weights and AdamW state are the same whatever the rank count, so a run may resume
# with another count (the sums then round differently: equal up to float rounding, not bit for bit).
_NOT_HASHED = ("checkpoint_every", "ranks")


def stage_settings(stage: str, settings: dict) -> dict:
    """`settings` with the schema's defaults filled in and checked; ClgptError naming the key on a bad value."""
    if stage not in STAGES:
        raise ClgptError(f"unknown stage {stage!r}; use one of {', '.join(STAGES)}")
    s = section_settings(stage, settings)
    s.setdefault("mix_pretrain", 0.0)  # pretrain has no such setting: it never mixes
    if s.get("lora", 0) is None:  # full tuning: settings (and checkpoints) as before adapters existed
        del s["lora"]
    if s.get("tuning") == "auto":  # the default: settings (and checkpoints) as before the device tuner existed
        del s["tuning"]
    if s.get("bucket") == 0:  # random batches: settings (and checkpoints) as before bucketing existed
        del s["bucket"]
    if s.get("optimizer") == "adamw":  # AdamW alone: settings (and checkpoints) as before Muon existed
        del s["optimizer"], s["muon"]
    if s.get("label_smoothing") == 0:  # the plain loss: settings (and checkpoints) as before label smoothing existed
        del s["label_smoothing"]
    if s.get("lora") and s["ranks"] > 1:
        raise ClgptError(f"{stage}.lora trains on one rank; set {stage}.ranks: 1 (now {s['ranks']})")
    if s["ranks"] > s["batch_size"]:
        raise ClgptError(f"{stage}.ranks={s['ranks']} is more than batch_size={s['batch_size']}: every rank needs "
                         "at least one row of each micro-batch; lower ranks or raise batch_size")
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


# ---- files ---------------------------------------------------------------------------------------

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
        if row.get("step") != str(len(kept) + 1) or any(
            not row.get(c) for c in LOG_COLUMNS if c not in _OPTIONAL_COLUMNS
        ):
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
    from clgpt.device.opencl import (
        resolve_device,  # OpenCL is imported only where a stage runs the engine
    )

    return resolve_device(device)


class _DeferStop:
    """The first stop signal (Ctrl-C, SIGTERM, SIGHUP: clgpt.signals) asks the loop to stop after the current
    step (so the checkpoint is consistent); a second one interrupts at once. Only in the main thread, where
    Python delivers signals."""

    def __init__(self):
        self.requested = 0  # the signal that asked, 0 for none
        self._previous = {}

    def __enter__(self):
        self._previous = signals.install(self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise signals.Stopped(signum)
        self.requested = signum
        name = signals.signal_name(signum)
        tqdm.write(f"{name}: stopping after this step and saving a checkpoint ({name} again to stop now)",
                   file=sys.stderr)

    def __exit__(self, *exc):
        signals.restore(self._previous)
        return False


# ---- the stage -----------------------------------------------------------------------------------

@dataclass
class _Progress:
    """What a checkpoint records beyond weights, optimizer and sampler state."""

    step: int = 0  # optimizer steps done
    smoothed_loss: float | None = None
    last_loss: float | None = None
    tokens_seen: int = 0
    best_loss: float | None = None  # lowest held-out loss so far (validation on)
    best_step: int = 0  # the step it was measured at


def _muon_on(s: dict) -> bool:
    """Whether the stage's block matrices take Muon (clgpt/ops/muon.py); its lr follows lr's schedule."""
    return s.get("optimizer", "adamw") == "muon"


def _resume_key(stage: str, s: dict, inp: _Inputs, total: int) -> str:
    """sha256 of everything that decides the weights: a .partial with another key is not resumed."""
    key = {"stage": stage, "cfg": json.loads(inp.cfg.to_json()), "total_steps": total, "inputs": inp.hashes,
           "settings": {k: v for k, v in s.items() if k not in _NOT_HASHED}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _tuned_knobs(setting: str, dev, cfg, batch_size: int, seq_len: int, stage: str, say, ranks: int = 1) -> Knobs:
    """The knobs with the `tuning` setting's records (clgpt.training.tuned), their choices in the log. The ranks of
    a data-parallel stage take auto's records from the cache only: each timing its own could differ."""
    try:
        kn, lines = tuned_knobs(setting, dev, cfg, batch_size, seq_len, read_knobs(), say=say, may_tune=ranks == 1)
    except ClgptError as e:
        raise ClgptError(f"{stage}.tuning: {e}") from None
    for line in lines:
        say(f"{stage}: {line}")
    return kn


def _say(root: bool):
    """tqdm.write to stderr on rank 0, nothing on the other ranks."""
    return (lambda msg: tqdm.write(msg, file=sys.stderr)) if root else (lambda msg: None)


def _resume(partial: str, key: str, eng, batches, stage: str, total: int, ranks: int = 1, root: bool = True) -> _Progress:
    """Load a matching .partial into the engine and the sampler; a fresh _Progress when there is none."""
    say = _say(root)
    if not os.path.exists(partial):
        return _Progress()
    try:
        ck = load_checkpoint(partial)
    except ClgptError as e:
        say(f"{stage}: ignoring unreadable {partial} ({e})")
        return _Progress()
    if ck["extra"].get("resume_key") != key:
        say(f"{stage}: {partial} is from other settings or data; starting afresh")
        return _Progress()
    eng.set_params(ck["params"])
    eng.set_optimizer_state(ck["opt_state"])
    batches.set_state(ck["rng_state"])
    say(f"{stage}: resuming from {partial} at step {ck['step']}/{total}")
    was = int(ck["extra"].get("ranks", 1))
    if was != ranks:
        say(f"{stage}: {partial} was written by a {was}-rank run, this run has {ranks}: same data order and "
            "state; gradient sums round differently from here on (equal up to float rounding, not bit for bit)")
    return _Progress(ck["step"], **ck["extra"]["progress"])


def accumulate_grads(eng, batches, accum: int, dist, stop_requested: int = 0,
                     overlap: bool = True, dropout_seed=None) -> tuple[float, int, int]:
    """One optimizer step's gradients: `accum` micro-batches from `batches`, each rank on its rows, summed
    over the ranks once per step (clgpt.training.dist), during the last micro-batch's backward pass when `overlap`
    (and the engine offers a grad_hook; else one reduce after the backward pass).
    dropout_seed(micro): the uint32 of that micro-batch's dropout masks, or None when dropout is off.
    stop_requested: the stop signal this rank got (0: none).
    -> (the whole batch's loss, real tokens, the stop signal a rank got, 0 for none)."""
    eng.zero_grad()
    loss, n_tokens = 0.0, 0
    reducer = dist.overlapped(eng) if overlap else None
    def drop(micro):
        return {} if dropout_seed is None else {"dropout_seed": dropout_seed(micro)}

    for micro in range(accum):
        tokens, targets, mask, n_real = batches.next()  # the whole micro-batch, on every rank
        n_tokens += n_real
        if dist.size == 1:
            loss += float(eng.forward(tokens, targets, mask, **drop(micro))) / accum
            eng.backward(1.0 / accum)
            continue
        # rank r: mean over its rows, weighted by its share m_r / M of the batch's mask sum
        rows = dist.rows(len(tokens))
        share = float(mask[rows].sum(dtype=np.float64)) / float(mask.sum(dtype=np.float64))
        last = reducer is not None and micro == accum - 1
        if last:
            reducer.begin()  # the gradients of each layer are final once the last backward is past it
        if share > 0:
            loss += float(eng.forward(tokens[rows], targets[rows], mask[rows], **drop(micro))) * share / accum
            eng.backward(share / accum)
        if last:
            reducer.end()
    if dist.size == 1:
        return loss, n_tokens, stop_requested
    if reducer is None:  # before clipping and AdamW
        eng.set_grads_flat(dist.allreduce_sum(eng.get_grads_flat()))
    parts = dist.allgather((loss, stop_requested))
    stop = next((int(p[1]) for p in parts if p[1]), 0)  # every rank stops alike, for the lowest rank's signal
    return math.fsum(p[0] for p in parts), n_tokens, stop


def _dropout_seed(seed: int, step: int, micro: int) -> int:
    """The uint32 that picks one micro-batch's dropout masks (the engine's counter-based generator)."""
    from clgpt.models.dropout import dropout_seed

    return dropout_seed(seed, step, micro)


class _Validation:
    """The held-out loss during training: fixed batches (evenly spaced windows of held-out text, or the
    held-out dialogs), the same at every evaluation, run with dropout off and unsmoothed (the plain NLL, as the
    evaluation stage measures it)."""

    def __init__(self, stage: str, heldout: str, s: dict, cfg: ModelConfig, tokenizer_hash: str | None):
        ids, meta = load_encoded(heldout)
        if tokenizer_hash and meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tokenizer_hash:
            raise ClgptError(f"{heldout}: encoded with another tokenizer; re-run the encode stage")
        B, T = s["batch_size"], s["seq_len"]
        if stage == "pretrain":
            if len(ids) < 2:
                raise ClgptError(f"{heldout}: held-out set has {len(ids)} tokens; add held-out text")
            self.batches = list(text_batches(ids, T, B, s["eval_tokens"]))
        else:
            rows, _ = dialog_rows(ids, meta, heldout, T)
            if s["eval_tokens"] > 0:  # whole dialogs until eval_tokens of them are read
                n, total = 0, 0
                while n < len(rows) and total < s["eval_tokens"]:
                    total += min(len(rows[n][0]) - 1, T)
                    n += 1
                rows = rows[:n]
            if not rows:
                raise ClgptError(f"{heldout}: no held-out dialog has its reply within seq_len={T} tokens")
            self.batches = list(dialog_batches(rows, T, B))
        self.hash = _sha256_file(heldout)

    def loss(self, eng, dist) -> float:
        """Each rank runs its rows of every batch (dist.rows); the sums meet on every rank."""
        total, count = 0.0, 0.0
        for tokens, targets, mask in self.batches:
            rows = dist.rows(len(tokens)) if dist.size > 1 else slice(None)
            n = float(mask[rows].sum())
            if n:
                total += float(eng.forward(tokens[rows], targets[rows], mask[rows], smoothed=False)) * n
                count += n
        if dist.size > 1:
            parts = dist.allgather((total, count))
            total, count = math.fsum(p[0] for p in parts), math.fsum(p[1] for p in parts)
        return total / count


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
    heldout: str | None = None,
    device=None,
    devices: list | None = None,
    tokenizer_hash: str | None = None,
    callback: Callable[[int, float], None] | None = None,
) -> dict:
    """Train one stage and write `ckpt_out` and `log_csv`.

    pretrain: a new model of shape `model` (ModelConfig fields; vocab_size from the data when 0/absent),
    initialised from settings.seed, trained on random windows of `encoded`.
    tune: continues from `init_ckpt` (its shape, never the config's) on the dialogs of `encoded`, loss on
    the replies only; `mix_encoded` supplies pretrain rows when settings.mix_pretrain > 0.
    heldout: the encoded held-out set; with settings.eval_every > 0 its loss is measured every eval_every
    steps and at the end (log.csv val_loss, the progress bar); keep: best then ships the weights of the
    lowest one, kept meanwhile in `ckpt_out + ".best"` (a resumed run keeps it); patience stops early.
    device: a clgpt.device.opencl.Device, or a spec string for clgpt.device.opencl.get_device (None = default choice).
    settings.ranks > 1: this process is one of that many MPI ranks (clgpt.training.dist); each rank runs on
    devices[local rank % len] when `devices` is given, else on the local-rank-th device `device` matches.
    callback(step, loss) runs after every optimizer step, on every rank (tests use it to interrupt a run).

    Returns {"stage", "steps", "total_steps", "final_loss", "smoothed_loss", "tokens_seen", "seconds",
    "resumed_from", "stopped_early", "dropped_rows", "best_step", "best_val_loss", "ranks"}.
    """
    from clgpt.training.dist import Dist

    s = stage_settings(stage, settings)
    dist = Dist.for_stage(stage, s["ranks"])
    with dist.guard():
        return _run_stage(stage, encoded, s, ckpt_out, log_csv, dist, model=model, init_ckpt=init_ckpt,
                          mix_encoded=mix_encoded, heldout=heldout, device=device, devices=devices,
                          tokenizer_hash=tokenizer_hash, callback=callback)


def _run_stage(stage, encoded, s, ckpt_out, log_csv, dist, *, model, init_ckpt, mix_encoded, heldout, device, devices,
               tokenizer_hash, callback) -> dict:
    say = _say(dist.root)
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
        say(f"{stage}: {batches.dropped} dialogs have no reply within seq_len={s['seq_len']} tokens; skipped")
    cut = [len(doc) for doc, _ in getattr(batches, "dialogs", ()) if len(doc) - 1 > s["seq_len"]]
    if cut:
        say(f"warning: {stage}: {len(cut)} dialogs are longer than {stage}.seq_len={s['seq_len']} tokens "
                   f"(the longest {max(cut)}) and are cut to it; raise {stage}.seq_len (at most model.n_ctx="
                   f"{cfg.n_ctx}) to train on all of them")
    validation = None
    if s["eval_every"] > 0:
        if heldout is None:
            raise ClgptError(f"{stage}.eval_every is set but there is no held-out set; set it to 0 or give one")
        validation = _Validation(stage, heldout, s, cfg, inp.tokenizer_hash)
        inp.hashes["heldout"] = validation.hash
    keep_best = validation is not None and s["keep"] == "best"
    B, T, accum = s["batch_size"], s["seq_len"], s["accum_steps"]
    if s["epochs"] > 0:
        total = max(1, math.ceil(s["epochs"] * batches.rows_per_epoch / ((B - batches.n_mix) * accum)))
    else:
        total = s["steps"]
    key = _resume_key(stage, s, inp, total)

    from clgpt.models.factory import make_engine  # GPT2Engine or LlamaEngine; needs OpenCL

    # the engine holds the most rows of a micro-batch one rank gets (all of them with one rank)
    dev = dist.device(device, devices) if dist.size > 1 else _resolve_device(device)
    lora = s.get("lora") and lora_spec(s["lora"], cfg, f"{stage}.lora")
    kn = _tuned_knobs(s.get("tuning", "auto"), dev, cfg, -(-B // dist.size), T, stage, say, dist.size)
    eng = make_engine(cfg, inp.params, batch_size=-(-B // dist.size), seq_len=T, device=dev, dropout=s["dropout"],
                      precision=s["precision"], optimizer=not lora, attention=s["attention"],
                      muon=_muon_on(s) and not lora, knobs=kn, label_smoothing=s.get("label_smoothing", 0.0))
    if s["precision"] == "auto":  # bf16 with tensor cores, or where the tuner timed bf16 storage faster
        say(f"{stage}: precision auto: {auto_reason(dev.device, kn)}")
    # model FLOPs utilisation beside tokens/s (nanochat's): None where clgpt.device.peaks knows no peak
    peak = peak_flops(dev.name, eng.precision)
    mfu_of = (lambda tok_s: "") if peak is None else (  # noqa: E731
        lambda tok_s, f=flops_per_token(cfg, T) / (peak * dist.size): f"{tok_s * f:.4f}")
    if lora:  # adapters on the frozen base (clgpt/models/lora.py); the engine runs the merged weights
        eng = LoraEngine(eng, lora, s["seed"])
    if dist.size > 1:
        share_rows = [(r + 1) * B // dist.size - r * B // dist.size for r in range(dist.size)]
        table = dist.describe(dev.name)  # collective: every rank calls it
        say(f"{stage}: {dist.size} ranks (MPI), rows per rank {share_rows} of {B}: {table}")
    partial, best_path = ckpt_out + ".partial", ckpt_out + ".best"
    prog = _resume(partial, key, eng, batches, stage, total, dist.size, dist.root)
    resumed_from = prog.step
    if keep_best:
        _resume_best(best_path, key, prog, stage)

    def save(path: str, sampler_state: dict) -> None:  # rank 0 only: every rank holds the same weights
        params = eng.get_params()
        bad = [n for n, w in params.items() if not np.isfinite(w).all()]
        if bad:
            raise ClgptError(
                f"{stage}: weights became non-finite ({bad[0]}) at step {prog.step}; the last good checkpoint "
                f"is kept at {partial}; lower {stage}.lr (now {s['lr']}) or grad_clip"
            )
        extra = {"stage": stage, "settings": s, "resume_key": key, "tokenizer_hash": inp.tokenizer_hash,
                 "total_steps": total, "dropped_rows": batches.dropped, "ranks": dist.size,
                 "progress": {k: v for k, v in vars(prog).items() if k != "step"}}
        if dist.size == 1:  # a one-rank checkpoint keeps the bytes it had before ranks existed
            extra["settings"] = {k: v for k, v in s.items() if k != "ranks"}
            del extra["ranks"]
        if path == partial:  # the log so far goes beside it: Snakemake deletes log.csv before a re-run. First:
            with atomic_path(log_partial) as tmp:  # killed between the two, the log has a row past the
                shutil.copyfile(log_csv, tmp)      # checkpoint (dropped on resume), never one row too few
        save_checkpoint(path, cfg, params, eng.get_optimizer_state(), prog.step, sampler_state, extra)

    log_partial = log_csv + ".partial"
    kept_rows = _read_log(log_partial if os.path.exists(log_partial) else log_csv, prog.step)

    log = writer = None
    if dist.root:
        elapsed_before = float(kept_rows[-1]["elapsed_s"]) if kept_rows else 0.0
        log = _start_log(log_csv, kept_rows)
        writer = csv.writer(log)
    bar = tqdm(total=total, initial=prog.step, desc=stage, unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not dist.root)
    t0 = time.perf_counter()
    resume_state = batches.state()  # the sampler's state at the start of step prog.step
    in_update, stopped_early = False, False
    try:
        with _DeferStop() as stop:
            while prog.step < total:
                t_step = time.perf_counter()
                lr = lr_at(prog.step, total, s["lr"], s["min_lr"], s["warmup_steps"])
                drop = None if s["dropout"] <= 0 else (lambda micro, step=prog.step: _dropout_seed(s["seed"], step, micro))
                loss, n_tokens, stop_asked = accumulate_grads(eng, batches, accum, dist, stop.requested,
                                                              dropout_seed=drop)
                if not math.isfinite(loss):
                    kept = (f"the last good checkpoint is kept at {partial}" if os.path.exists(partial)
                            else "no checkpoint was written yet")
                    raise ClgptError(
                        f"{stage}: loss became {loss} at step {prog.step + 1}; {kept}; lower {stage}.lr "
                        f"(now {s['lr']}) or raise warmup_steps"
                    )
                in_update = True
                muon = dict(s["muon"], lr=s["muon"]["lr"] * lr / s["lr"]) if _muon_on(s) and not lora else None
                norm = float(eng.step(lr, s["beta1"], s["beta2"], ADAM_EPS, s["weight_decay"], s["grad_clip"], muon))
                prog.step += 1
                resume_state = batches.state()
                prog.tokens_seen += n_tokens
                prog.last_loss = loss
                prev = loss if prog.smoothed_loss is None else prog.smoothed_loss
                prog.smoothed_loss = SMOOTHING * prev + (1 - SMOOTHING) * loss
                in_update = False
                now = time.perf_counter()
                tok_s = n_tokens / max(now - t_step, 1e-9)

                val_loss, patience_out = None, False
                if validation is not None and (prog.step % s["eval_every"] == 0 or prog.step == total):
                    val_loss = validation.loss(eng, dist)
                    if prog.best_loss is None or val_loss < prog.best_loss:
                        prog.best_loss, prog.best_step = val_loss, prog.step
                        if keep_best and dist.root:
                            save(best_path, resume_state)
                    evals_since = (prog.step - prog.best_step) // s["eval_every"]
                    patience_out = 0 < s["patience"] <= evals_since
                if writer is not None:
                    writer.writerow([prog.step, f"{loss:.6f}", f"{lr:.6g}", f"{norm:.6g}", f"{tok_s:.1f}",
                                     mfu_of(tok_s),
                                     f"{elapsed_before + now - t0:.3f}", "" if val_loss is None else f"{val_loss:.6f}"])
                    log.flush()
                post = {"loss": f"{prog.smoothed_loss:.4f}"}
                if prog.best_loss is not None:
                    post["val"] = f"{prog.best_loss:.4f}@{prog.best_step}"
                post.update(lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
                bar.set_postfix(post, refresh=False)
                bar.update(1)
                if val_loss is not None:
                    say(f"{stage}: step {prog.step}: held-out loss {val_loss:.4f} (best {prog.best_loss:.4f} "
                        f"at step {prog.best_step})")

                if prog.step % s["checkpoint_every"] == 0 and prog.step < total and dist.root:
                    save(partial, resume_state)
                if callback is not None:
                    callback(prog.step, loss)
                if stop_asked:
                    raise signals.Stopped(stop_asked)
                if patience_out and prog.step < total:
                    stopped_early = True
                    say(f"{stage}: no better held-out loss in {s['patience']} evaluations; stopping at step "
                        f"{prog.step} (best {prog.best_loss:.4f} at step {prog.best_step})")
                    break
                if 0 < s["target_loss"] and prog.smoothed_loss <= s["target_loss"]:
                    stopped_early = prog.step < total
                    say(f"{stage}: smoothed loss {prog.smoothed_loss:.4f} <= target {s['target_loss']} "
                        f"at step {prog.step}")
                    break
    except KeyboardInterrupt as e:
        bar.close()
        signum = signals.signum_of(e)
        why = "interrupted" if signum == signal.SIGINT else f"stopped by {signals.signal_name(signum)}"
        if in_update:  # a second signal inside Engine.step: the weights may be half updated
            say(f"{stage}: {why} while updating the weights; the last checkpoint stays")
        elif dist.root:
            save(partial, resume_state)
            say(f"{stage}: {why}; saved step {prog.step} to {partial}; run again to resume")
        if log is not None:  # its rows up to the saved step are in log_partial; a log.csv left behind would be
            log.close()      # an output Snakemake marked incomplete, and the next run would stop on it
            log = None
            os.remove(log_csv)
        raise
    finally:
        bar.close()
        if log is not None:
            log.close()

    if dist.root:
        if keep_best and os.path.exists(best_path):
            say(f"{stage}: keeping the best held-out loss {prog.best_loss:.4f}, step {prog.best_step} "
                f"of {prog.step} (keep: best)")
            os.replace(best_path, ckpt_out)
        else:
            save(ckpt_out, resume_state)
        for path in (partial, best_path, log_partial):
            if os.path.exists(path):
                os.remove(path)
    dist.barrier()  # the stage ends when its output is written, on every rank
    return {
        "stage": stage, "steps": prog.step, "total_steps": total, "final_loss": prog.last_loss,
        "smoothed_loss": prog.smoothed_loss, "tokens_seen": prog.tokens_seen, "seconds": time.perf_counter() - t0,
        "resumed_from": resumed_from, "stopped_early": stopped_early, "dropped_rows": batches.dropped,
        "best_step": prog.best_step, "best_val_loss": prog.best_loss, "ranks": dist.size,
    }


def _resume_best(best_path: str, key: str, prog: _Progress, stage: str) -> None:
    """After a resume, the best-so-far is the `.best` file's (it may be newer than the .partial: the run
    is deterministic, so replaying the steps after the .partial measures the same losses again)."""
    if not os.path.exists(best_path):
        prog.best_loss, prog.best_step = None, 0
        return
    try:
        ck = load_checkpoint(best_path)
    except ClgptError:
        os.remove(best_path)
        prog.best_loss, prog.best_step = None, 0
        return
    if ck["extra"].get("resume_key") != key:
        os.remove(best_path)  # from other settings or data
        prog.best_loss, prog.best_step = None, 0
        return
    p = ck["extra"]["progress"]
    prog.best_loss, prog.best_step = p.get("best_loss"), int(p.get("best_step", ck["step"]))
    if prog.step:
        tqdm.write(f"{stage}: best held-out loss so far {prog.best_loss:.4f} at step {prog.best_step} "
                   f"({best_path})", file=sys.stderr)
