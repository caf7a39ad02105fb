"""The training loop on a tiny model: loss goes down, accumulation, the lr schedule, the reply-only mask,
checkpoints, determinism, exact resume (after Ctrl-C and after kill -9), NaN handling."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from clgpt.device.knobs import Knobs
from clgpt.errors import ClgptError
from clgpt.io.checkpoint import load_checkpoint, save_checkpoint
from clgpt.model import ModelConfig, init_params
from clgpt.training.train import (
    DialogBatches,
    PretrainBatches,
    lr_at,
    pad_dialogs,
    run_stage,
    stage_settings,
)
from test_pipeline import assert_one_line, default_signals

ROOT = Path(__file__).resolve().parent.parent
V = 40  # ids 0..35 "text", 36..39 the specials
BOS, EOS, USER, ASSISTANT = 36, 37, 38, 39
TINY = {"vocab_size": 0, "n_ctx": 16, "n_embd": 16, "n_head": 2, "n_layer": 1, "n_ff": 32}


def write_encoded(path: Path, docs: list[list[int]], kind: str = "text", assistant_pos=None) -> str:
    """An encoded .bin + .json sidecar as the encode stage writes them; assistant_pos relative per doc (its
    reply and end token count: one loss span to the end)."""
    ids = np.concatenate([np.asarray(d, dtype=np.uint16) for d in docs])
    ids.tofile(path)
    starts = np.cumsum([0] + [len(d) for d in docs])
    meta = {
        "version": 1, "dtype": "uint16", "n_tokens": int(ids.size), "n_documents": len(docs), "vocab_size": V,
        "tokenizer_hash": "test-tokenizer", "kind": kind, "source_sha256": "0" * 64,
        "documents": [[int(a), int(b)] for a, b in zip(starts[:-1], starts[1:])],
    }
    if kind == "dialog":
        meta["loss_spans"] = [[[int(a), len(d) - 1]] for d, a in zip(docs, assistant_pos)]
    path.with_suffix(".json").write_text(json.dumps(meta))
    return str(path)


def text_docs(n: int = 60) -> list[list[int]]:
    """Documents with an easy pattern: counting up from a start, so the loss can fall fast."""
    return [[BOS, *range(i % 7, i % 7 + 6 + i % 3), EOS] for i in range(n)]


def dialog_docs(n: int = 10) -> tuple[list[list[int]], list[int]]:
    docs, pos = [], []
    for i in range(n):
        user = [(i * 5 + k) % 30 for k in range(2 + i % 3)]
        reply = [(i + k) % 30 for k in range(3 + i % 2)]
        ids = [BOS, USER, *user, ASSISTANT]
        pos.append(len(ids) - 1)
        docs.append(ids + reply + [EOS])
    return docs, pos


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("encoded")
    docs, pos = dialog_docs()
    return {
        "text": write_encoded(d / "pretrain.bin", text_docs()),
        "dialog": write_encoded(d / "tune.bin", docs, "dialog", pos),
    }


def settings(**kw) -> dict:
    s = {"seed": 7, "steps": 12, "epochs": 0, "batch_size": 4, "seq_len": 12, "lr": 1e-2, "min_lr": 1e-3,
         "warmup_steps": 3, "checkpoint_every": 4}
    s.update(kw)
    return s


def pretrain(data, out: Path, **kw) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    return run_stage("pretrain", data["text"], settings(**kw), str(out / "model.ckpt"), str(out / "log.csv"),
                     model=TINY, tokenizer_hash="test-tokenizer")


def read_log(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrained")
    pretrain(data, out, steps=20)
    return str(out / "model.ckpt")


def tune(data, pretrained, out: Path, **kw) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    kw.setdefault("steps", 10)
    return run_stage("tune", data["dialog"], settings(**kw), str(out / "model.ckpt"), str(out / "log.csv"),
                     init_ckpt=pretrained, mix_encoded=data["text"])


class StopAt(Exception):
    pass


def stop_at(k: int, exc=KeyboardInterrupt):
    def callback(step, loss):
        if step == k:
            raise exc()
    return callback


def assert_resume_is_bit_identical(tmp_path, args, model):
    """args(out) -> run_stage's arguments writing into out: a run stopped at step 5 and run again ends with the
    bytes of an uninterrupted one."""
    for name in ("full", "resumed"):
        (tmp_path / name).mkdir()
    run_stage(*args(tmp_path / "full"), model=model)
    with pytest.raises(KeyboardInterrupt):
        run_stage(*args(tmp_path / "resumed"), model=model, callback=stop_at(5))
    run_stage(*args(tmp_path / "resumed"), model=model)
    full = (tmp_path / "full" / "model.ckpt").read_bytes()
    assert (tmp_path / "resumed" / "model.ckpt").read_bytes() == full


# ---- the schedule and the settings ----

@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_lr_schedule_matches_formula(warmup):
    total, lr, min_lr = 50, 1e-3, 1e-4
    got = [lr_at(s, total, lr, min_lr, warmup) for s in range(total)]
    for s, value in enumerate(got):
        if s < warmup:
            want = lr * (s + 1) / warmup
        else:
            want = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * (s - warmup) / (total - warmup - 1)))
        assert value == pytest.approx(want, rel=1e-12), s
    if warmup:
        assert got[warmup - 1] == pytest.approx(lr)
    assert got[warmup] == pytest.approx(lr)
    assert got[-1] == pytest.approx(min_lr)
    assert all(a >= b for a, b in zip(got[warmup:], got[warmup + 1:]))


def test_settings_defaults_and_errors():
    s = stage_settings("tune", {})
    assert s["accum_steps"] == 1 and s["target_loss"] == 0 and s["mix_pretrain"] == 0
    with pytest.raises(ClgptError, match="unknown key 'pretrain.stpes'; did you mean 'steps'"):
        stage_settings("pretrain", {"stpes": 3})
    with pytest.raises(ClgptError, match="tune.mix_pretrain"):
        stage_settings("tune", {"mix_pretrain": 1.0})
    with pytest.raises(ClgptError, match="pretrain.batch_size"):
        stage_settings("pretrain", {"batch_size": 0})


# ---- training ----

def test_pretrain_loss_goes_down_and_logs(data, tmp_path):
    summary = pretrain(data, tmp_path, steps=40, checkpoint_every=100)
    rows = read_log(tmp_path / "log.csv")
    assert list(rows[0]) == ["step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s", "val_loss"]
    assert all(r["mfu"] == "" for r in rows)  # no peak known for a CPU: no MFU
    assert [int(r["step"]) for r in rows] == list(range(1, 41))
    losses = [float(r["loss"]) for r in rows]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    assert summary["steps"] == 40 and summary["tokens_seen"] == 40 * 4 * 12
    assert not os.path.exists(str(tmp_path / "model.ckpt") + ".partial")
    ck = load_checkpoint(str(tmp_path / "model.ckpt"))
    assert ck["step"] == 40 and ck["cfg"] == ModelConfig.from_dict({**TINY, "vocab_size": V})
    assert ck["extra"]["tokenizer_hash"] == "test-tokenizer"


def test_accumulation_equals_one_big_batch(data, tmp_path):
    # Two micro-batches of b rows draw the same windows as one batch of 2b rows.
    a = PretrainBatches(np.arange(200), stage_settings("pretrain", settings(batch_size=2)), "x")
    b = PretrainBatches(np.arange(200), stage_settings("pretrain", settings(batch_size=4)), "x")
    assert np.array_equal(np.concatenate([a.next()[0], a.next()[0]]), b.next()[0])

    pretrain(data, tmp_path / "accum", steps=4, batch_size=2, accum_steps=2)
    pretrain(data, tmp_path / "big", steps=4, batch_size=4, accum_steps=1)
    pa = load_checkpoint(str(tmp_path / "accum" / "model.ckpt"))["params"]
    pb = load_checkpoint(str(tmp_path / "big" / "model.ckpt"))["params"]
    for name in pa:
        diff = np.abs(pa[name] - pb[name]).max()
        assert np.allclose(pa[name], pb[name], rtol=1e-4, atol=2e-5), f"{name}: max diff {diff}"
    la = [float(r["loss"]) for r in read_log(tmp_path / "accum" / "log.csv")]
    lb = [float(r["loss"]) for r in read_log(tmp_path / "big" / "log.csv")]
    assert np.allclose(la, lb, rtol=1e-4)


def test_dialog_batches_mask_only_the_reply(data):
    from clgpt.data import load_encoded

    ids, meta = load_encoded(data["dialog"])
    batches = DialogBatches(ids, meta, stage_settings("tune", settings(batch_size=3)), "tune.bin")
    tokens, targets, mask, n_real = batches.next()
    docs, pos = dialog_docs()
    for r in range(3):
        doc = next(d for d in docs if len(d) - 1 <= tokens.shape[1] and np.array_equal(d[:-1], tokens[r, : len(d) - 1]))
        a, L = pos[docs.index(doc)], len(doc) - 1
        assert np.array_equal(targets[r, :L], doc[1:])
        assert np.array_equal(mask[r], [1.0 if a <= j < L else 0.0 for j in range(tokens.shape[1])])
        assert targets[r, a] == doc[a + 1] and tokens[r, a] == ASSISTANT  # first counted target: the reply
        assert targets[r, L - 1] == EOS and mask[r, L - 1] == 1.0  # </s> counts
    assert n_real == sum(len(d) - 1 for d in docs if any(np.array_equal(d[:-1], t[: len(d) - 1]) for t in tokens))


def test_bucketed_dialog_batches_pad_less_and_draw_each_dialog_once_an_epoch(tmp_path):
    from clgpt.data import load_encoded

    # 30 dialogs (no token 0, the padding), a third of them 50 to 59 tokens, the rest 6 to 15: batches of 4
    # rows pad to 32 or 64 tokens
    docs = [[BOS, USER, *[1 + (i + k) % 29 for k in range(1 + i % 10 + 44 * (i % 3 == 0))], ASSISTANT, 5, EOS]
            for i in range(30)]
    pos = [len(d) - 3 for d in docs]
    ids, meta = load_encoded(write_encoded(tmp_path / "tune.bin", docs, "dialog", pos))
    widths = {}
    for bucket in (0, 8):
        b = DialogBatches(ids, meta, stage_settings("tune", settings(batch_size=4, seq_len=96, bucket=bucket)),
                          "tune.bin")
        firsts, w = [], []
        for _ in range(15):  # an epoch and a half: 30 rows is not a whole number of batches of 4
            tokens, _, _, _ = b.next()
            w.append(tokens.shape[1])
            firsts += [int(np.count_nonzero(r)) for r in tokens]
        assert sorted(firsts[:30]) == sorted(len(d) - 1 for d in docs), bucket  # each dialog once in the 1st epoch
        widths[bucket] = w
    assert sum(widths[8]) < 0.8 * sum(widths[0]), widths


def test_tune_loss_ignores_user_targets(data, pretrained):
    from clgpt.data import load_encoded
    from clgpt.models.factory import make_engine

    ck = load_checkpoint(pretrained)
    ids, meta = load_encoded(data["dialog"])
    batches = DialogBatches(ids, meta, stage_settings("tune", settings(batch_size=4)), "tune.bin")
    tokens, targets, mask, _ = batches.next()
    eng = make_engine(ck["cfg"], ck["params"], batch_size=4, seq_len=12, knobs=Knobs())
    loss = eng.forward(tokens, targets, mask)
    changed = np.where(mask == 0, (targets + 11) % 30, targets).astype(np.int32)
    assert (changed != targets).any()
    assert eng.forward(tokens, changed, mask) == pytest.approx(loss, rel=1e-6)
    reply_changed = np.where(mask == 1, (targets + 11) % 30, targets).astype(np.int32)
    assert abs(eng.forward(tokens, reply_changed, mask) - loss) > 1e-3


def test_pad_dialogs_caps_at_seq_len():
    doc = np.arange(20, dtype=np.int32)
    tokens, targets, mask, n_real = pad_dialogs([(doc, [(3, 19)]), (doc[:6], [(2, 5)])], 8)
    assert tokens.shape == (2, 8) and n_real == 8 + 5
    assert np.array_equal(mask[0], [0, 0, 0, 1, 1, 1, 1, 1])
    assert np.array_equal(mask[1], [0, 0, 1, 1, 1, 0, 0, 0])
    assert np.array_equal(targets[0], np.arange(1, 9))


def test_pad_dialogs_masks_every_assistant_turn_and_nothing_else():
    doc = np.arange(14, dtype=np.int32)
    _, _, mask, _ = pad_dialogs([(doc, [(2, 4), (8, 11)])], 16)
    assert np.array_equal(mask[0], [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0])


def test_tune_trains_and_mixes(data, pretrained, tmp_path):
    summary = tune(data, pretrained, tmp_path, epochs=3, mix_pretrain=0.25)
    # 10 dialogs, 3 dialog rows a step -> ceil(3 * 10 / 3) steps
    assert summary["total_steps"] == summary["steps"] == 10
    ck = load_checkpoint(str(tmp_path / "model.ckpt"))
    assert ck["cfg"] == load_checkpoint(pretrained)["cfg"]
    assert ck["rng_state"]["epoch"] == 2 and ck["rng_state"]["pos"] == 10


def test_tune_takes_shape_from_checkpoint(data, pretrained, tmp_path):
    with pytest.raises(ClgptError, match="init_ckpt"):
        run_stage("tune", data["dialog"], settings(), str(tmp_path / "m.ckpt"), str(tmp_path / "l.csv"),
                  model=TINY, init_ckpt=pretrained)


def test_target_loss_stops_early(data, tmp_path):
    summary = pretrain(data, tmp_path, steps=40, target_loss=3.5)
    assert summary["stopped_early"] and summary["steps"] < 40
    assert load_checkpoint(str(tmp_path / "model.ckpt"))["step"] == summary["steps"]


def test_label_smoothing_trains_smoothed_and_validates_plain(data, tmp_path):
    """pretrain.label_smoothing: the held-out loss in the log is the plain NLL of the weights (the one the
    evaluation stage measures), not the smoothed training loss; the setting is in the checkpoint, and absent
    there at 0, so a run without it keeps the settings (and bytes) it had before the setting existed."""
    from clgpt.data import load_encoded, text_batches
    from clgpt.models.factory import make_engine

    assert "label_smoothing" not in stage_settings("pretrain", {"label_smoothing": 0.0})
    s = settings(steps=4, eval_every=4, keep="last", label_smoothing=0.1)
    run_stage("pretrain", data["text"], s, str(tmp_path / "model.ckpt"), str(tmp_path / "log.csv"), model=TINY,
              heldout=data["text"], tokenizer_hash="test-tokenizer")
    ck = load_checkpoint(str(tmp_path / "model.ckpt"))
    assert ck["extra"]["settings"]["label_smoothing"] == 0.1
    val = float(read_log(tmp_path / "log.csv")[-1]["val_loss"])
    eng = make_engine(ck["cfg"], ck["params"], batch_size=4, seq_len=12, knobs=Knobs(), label_smoothing=0.1)
    ids, _ = load_encoded(data["text"])

    def held_out(smoothed: bool) -> float:
        total = count = 0.0
        for tokens, targets, mask in text_batches(ids, 12, 4):
            n = float(mask.sum())
            total += eng.forward(tokens, targets, mask, smoothed=smoothed) * n
            count += n
        return total / count

    assert val == pytest.approx(held_out(False), abs=2e-6)
    assert abs(held_out(True) - val) > 1e-3


# ---- checkpoints ----

def test_checkpoint_round_trip(tmp_path):
    cfg = ModelConfig(vocab_size=V, n_ctx=16, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    params = init_params(cfg, 3)
    opt = {"m": {k: v * 2 for k, v in params.items()}, "v": {k: v * v for k, v in params.items()}, "t": 5,
           "lr_scale": np.float32(0.5)}
    rng = {"rng": np.random.default_rng(1).bit_generator.state, "order": np.arange(5), "epoch": 2}
    extra = {"stage": "tune", "smoothed_loss": 1.25, "nothing": None, "list": [1, "a", np.ones(2)]}
    path = str(tmp_path / "a.ckpt")
    save_checkpoint(path, cfg, params, opt, 9, rng, extra)
    assert not os.path.exists(path + ".tmp")
    ck = load_checkpoint(path)
    assert ck["cfg"] == cfg and ck["step"] == 9
    for k in params:
        assert np.array_equal(ck["params"][k], params[k]) and ck["params"][k].dtype == np.float32
        assert np.array_equal(ck["opt_state"]["m"][k], opt["m"][k])
    assert ck["opt_state"]["t"] == 5 and type(ck["opt_state"]["t"]) is int
    assert ck["opt_state"]["lr_scale"] == np.float32(0.5) and ck["opt_state"]["lr_scale"].dtype == np.float32
    assert ck["rng_state"]["rng"] == rng["rng"] and np.array_equal(ck["rng_state"]["order"], np.arange(5))
    assert ck["extra"]["nothing"] is None and np.array_equal(ck["extra"]["list"][2], np.ones(2))
    with np.load(path) as npz:  # plain numpy reads it too
        assert np.array_equal(npz["params/token_embd.weight"], params["token_embd.weight"])
    # same contents -> same bytes
    save_checkpoint(str(tmp_path / "b.ckpt"), cfg, params, opt, 9, rng, extra)
    assert Path(path).read_bytes() == (tmp_path / "b.ckpt").read_bytes()


def test_bad_checkpoint_names_the_file(tmp_path):
    bad = tmp_path / "bad.ckpt"
    with pytest.raises(ClgptError, match="bad.ckpt: checkpoint not found"):
        load_checkpoint(str(bad))
    bad.write_bytes(b"not a zip")
    with pytest.raises(ClgptError, match="bad.ckpt: not a readable clgpt checkpoint"):
        load_checkpoint(str(bad))
    cfg = ModelConfig(vocab_size=V, n_ctx=16, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    good = tmp_path / "good.ckpt"
    save_checkpoint(str(good), cfg, init_params(cfg, 0), None, 0, None)
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ClgptError, match="bad.ckpt: not a readable clgpt checkpoint"):
        load_checkpoint(str(bad))


def test_mfu_is_tokens_per_second_times_flops_per_token_over_the_peak(data, tmp_path, monkeypatch):
    import clgpt.training.train as train
    from clgpt.model import ModelConfig, flops_per_token

    asked = []
    monkeypatch.setattr(train, "peak_flops", lambda name, precision: asked.append((name, precision)) or 1e9)
    pretrain(data, tmp_path, steps=4)
    assert asked and asked[0][1] == "fp32"
    cfg = ModelConfig(**{**TINY, "vocab_size": V})
    for r in read_log(tmp_path / "log.csv"):
        want = float(r["tokens_per_s"]) * flops_per_token(cfg, 12) / 1e9
        assert abs(float(r["mfu"]) - want) <= 1e-4 + 1e-3 * want, r


# ---- determinism and resume ----

def test_same_settings_same_checkpoint_bytes(data, tmp_path):
    pretrain(data, tmp_path / "a")
    pretrain(data, tmp_path / "b")
    assert (tmp_path / "a" / "model.ckpt").read_bytes() == (tmp_path / "b" / "model.ckpt").read_bytes()


@pytest.mark.parametrize("stop", [1, 5, 8])
def test_resume_after_ctrl_c_is_bit_identical(data, tmp_path, stop):
    pretrain(data, tmp_path / "full")
    out = tmp_path / "resumed"
    out.mkdir()
    args = ("pretrain", data["text"], settings(), str(out / "model.ckpt"), str(out / "log.csv"))
    with pytest.raises(KeyboardInterrupt):
        run_stage(*args, model=TINY, tokenizer_hash="test-tokenizer", callback=stop_at(stop))
    assert not (out / "model.ckpt").exists()
    assert load_checkpoint(str(out / "model.ckpt") + ".partial")["step"] == stop
    summary = run_stage(*args, model=TINY, tokenizer_hash="test-tokenizer")
    assert summary["resumed_from"] == stop
    assert (out / "model.ckpt").read_bytes() == (tmp_path / "full" / "model.ckpt").read_bytes()
    assert not (out / "model.ckpt.partial").exists()
    rows = read_log(out / "log.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    full = read_log(tmp_path / "full" / "log.csv")
    assert [r["loss"] for r in rows] == [r["loss"] for r in full]


def test_resume_drops_log_rows_past_the_checkpoint(data, tmp_path):
    """A crash after step 6 with the last checkpoint at 4: rows 5 and 6 are rewritten, not duplicated."""
    args = ("pretrain", data["text"], settings(), str(tmp_path / "model.ckpt"), str(tmp_path / "log.csv"))
    with pytest.raises(StopAt):
        run_stage(*args, model=TINY, callback=stop_at(6, StopAt))
    assert load_checkpoint(str(tmp_path / "model.ckpt.partial"))["step"] == 4
    assert len(read_log(tmp_path / "log.csv")) == 6
    run_stage(*args, model=TINY)
    assert [int(r["step"]) for r in read_log(tmp_path / "log.csv")] == list(range(1, 13))


def test_tune_resume_across_epochs_is_bit_identical(data, pretrained, tmp_path):
    kw = dict(steps=10, epochs=3, mix_pretrain=0.25, checkpoint_every=3)
    tune(data, pretrained, tmp_path / "full", **kw)
    out = tmp_path / "resumed"
    out.mkdir()
    args = ("tune", data["dialog"], settings(**kw), str(out / "model.ckpt"), str(out / "log.csv"))
    with pytest.raises(KeyboardInterrupt):
        run_stage(*args, init_ckpt=pretrained, mix_encoded=data["text"], callback=stop_at(4))
    run_stage(*args, init_ckpt=pretrained, mix_encoded=data["text"])
    assert (out / "model.ckpt").read_bytes() == (tmp_path / "full" / "model.ckpt").read_bytes()


def test_partial_from_other_settings_is_ignored(data, tmp_path):
    pretrain(data, tmp_path / "full")
    out = tmp_path / "other"
    with pytest.raises(KeyboardInterrupt):
        out.mkdir()
        run_stage("pretrain", data["text"], settings(lr=5e-3), str(out / "model.ckpt"), str(out / "log.csv"),
                  model=TINY, tokenizer_hash="test-tokenizer", callback=stop_at(6))
    summary = pretrain(data, out)
    assert summary["resumed_from"] == 0
    assert (out / "model.ckpt").read_bytes() == (tmp_path / "full" / "model.ckpt").read_bytes()


def _start_slow_run(data, out: Path, steps: int, stage: str = "pretrain", pretrained: str | None = None
                    ) -> subprocess.Popen:
    """A real pretrain or tune run in another process, as a stage script runs it (clgpt.stage.run_script),
    slowed down so a test can signal it mid-run."""
    kw = (dict(model=TINY, tokenizer_hash="test-tokenizer") if stage == "pretrain"
          else dict(init_ckpt=pretrained, mix_encoded=data["text"]))
    encoded = data["text"] if stage == "pretrain" else data["dialog"]
    code = textwrap.dedent(f"""
        import time
        from clgpt.stage import run_script
        from clgpt.training.train import run_stage
        def main():
            run_stage({stage!r}, {encoded!r}, {settings(steps=steps, checkpoint_every=1)!r},
                      {str(out / "model.ckpt")!r}, {str(out / "log.csv")!r},
                      callback=lambda step, loss: time.sleep(0.05), **{kw!r})
        run_script(main, None)
    """)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)


def _signal_after_step(proc: subprocess.Popen, partial: Path, step: int, sig: int) -> tuple[int, str]:
    """Sends `sig` once the run has checkpointed `step`; the run's exit status and stderr."""
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if partial.exists() and load_checkpoint(str(partial))["step"] >= step:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be signalled"
        os.kill(proc.pid, sig)
        err = proc.communicate(timeout=120)[1]
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("stage", ["pretrain", "tune"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGKILL", "SIGINT", "SIGTERM", "SIGHUP"])
def test_resume_after_kill_is_bit_identical(data, pretrained, tmp_path, sig, stage):
    """Ctrl-C, SIGTERM (`kill`, a cluster's time limit) and SIGHUP (the terminal closed) each finish the step,
    save it and end the stage with one line; SIGKILL loses the steps since the last checkpoint. The re-run
    resumes where the run stopped and writes the uninterrupted run's bytes."""
    full = tmp_path / "full"
    if stage == "pretrain":
        pretrain(data, full, steps=30, checkpoint_every=1)
    else:
        tune(data, pretrained, full, steps=30, checkpoint_every=1)
    out = tmp_path / "killed"
    out.mkdir()
    partial = out / "model.ckpt.partial"
    code, err = _signal_after_step(_start_slow_run(data, out, 30, stage, pretrained), partial, 3, sig)
    stopped_at = load_checkpoint(str(partial))["step"]
    assert not (out / "model.ckpt").exists()
    assert 3 <= stopped_at < 30
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:  # finishes the step, saves, exits as a shell reports the signal, with one line
        what = "interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
        assert code == 128 + sig, err
        assert f"{stage}: {what}; saved step {stopped_at} to {partial}; run again to resume" in err, err
        assert [line for line in err.splitlines() if line.startswith("error: ")] == \
            [f"error: {what}; run snakemake again to resume"], err
        assert_one_line(err)
        # the log so far waits beside the checkpoint; no log.csv output is left half done
        assert len(read_log(out / "log.csv.partial")) == stopped_at
        assert not (out / "log.csv").exists()
    summary = (pretrain(data, out, steps=30, checkpoint_every=1) if stage == "pretrain"
               else tune(data, pretrained, out, steps=30, checkpoint_every=1))
    assert summary["resumed_from"] == stopped_at
    assert (out / "model.ckpt").read_bytes() == (full / "model.ckpt").read_bytes()
    assert [int(r["step"]) for r in read_log(out / "log.csv")] == list(range(1, 31))


def test_nan_loss_stops_and_keeps_the_partial(data, tmp_path):
    with pytest.raises(ClgptError, match=r"(loss became (nan|inf)|non-finite).*at step \d+.*lower pretrain.lr"):
        pretrain(data, tmp_path, lr=1e30, warmup_steps=0, checkpoint_every=1)
    assert not (tmp_path / "model.ckpt").exists()
    ck = load_checkpoint(str(tmp_path / "model.ckpt.partial"))
    assert all(np.isfinite(w).all() for w in ck["params"].values())


@pytest.mark.parametrize("model", [TINY, {**TINY, "arch": "llama", "n_head_kv": 1, "n_expert": 2, "n_expert_used": 1}],
                         ids=["gpt2", "llama-moe"])
def test_muon_resume_is_bit_identical_and_muon_moves_the_weights(data, tmp_path, model):
    """optimizer: muon: the momentum rides in the checkpoint, so a run stopped at step 5 resumes to the same bytes;
    and the run is not AdamW's under another name."""
    kw = {"steps": 8, "optimizer": "muon", "muon": {"lr": 0.05}, "accum_steps": 2}
    args = lambda out, **k: ("pretrain", data["text"], settings(**{**kw, **k}), str(out / "model.ckpt"),  # noqa: E731
                             str(out / "log.csv"))
    assert_resume_is_bit_identical(tmp_path, args, model)
    (tmp_path / "adamw").mkdir()
    run_stage(*args(tmp_path / "adamw", optimizer="adamw"), model=model)
    a, b = (load_checkpoint(str(tmp_path / n / "model.ckpt")) for n in ("full", "adamw"))
    assert a["extra"]["settings"]["optimizer"] == "muon" and "optimizer" not in b["extra"]["settings"]
    assert not np.array_equal(a["params"]["blk.0.attn_output.weight"], b["params"]["blk.0.attn_output.weight"])


@pytest.mark.parametrize("extra", [{}, {"n_expert": 2, "n_expert_used": 1}], ids=["dense", "moe"])
def test_llama_resume_is_bit_identical(data, tmp_path, extra):
    model = {**TINY, "arch": "llama", "n_head_kv": 1, **extra}
    args = lambda out: ("pretrain", data["text"], settings(steps=8), str(out / "model.ckpt"), str(out / "log.csv"))
    assert_resume_is_bit_identical(tmp_path, args, model)
    assert load_checkpoint(str(tmp_path / "full" / "model.ckpt"))["cfg"].arch == "llama"
