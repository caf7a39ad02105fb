"""The evaluate stage on a tiny pretrained + tuned model: files, metric keys, held-out loss against the
float64 reference, exact-match scoring."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from clgpt import reference
from clgpt.checkpoint import load_checkpoint
from clgpt.data import encode_dialog_files, encode_text_files, load_encoded, read_dialogs
from clgpt.evaluate import exact_match, run_evaluate, score, text_batches
from clgpt.tokenizer import Tokenizer
from clgpt.train import run_stage

TEXT = ["The cat sat on the mat.", "A dog ran in the park.", "The sun is warm today.", "Birds sing in the morning."]
DIALOGS = [
    {"user": "Say hi.", "assistant": "Hi!"},
    {"user": "Who are you?", "assistant": "A tiny model."},
    {"user": "What is two plus two?", "assistant": "Four."},
]
HELDOUT = [{"user": "Say hello.", "assistant": "Hello!"}]
TINY = {"n_ctx": 32, "n_embd": 16, "n_head": 2, "n_layer": 1, "n_ff": 32}
TRAIN = {"seed": 3, "batch_size": 4, "seq_len": 16, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2}


def _jsonl(path, dialogs):
    path.write_text("".join(json.dumps(d) + "\n" for d in dialogs))
    return str(path)


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    (d / "pretrain.txt").write_text("\n".join(TEXT * 3) + "\n")
    (d / "heldout.txt").write_text("The cat ran in the sun.\nA bird sat on the dog.\n")
    tok = Tokenizer.train(TEXT + [t for x in DIALOGS for t in x.values()], 300)
    tok.save(d / "tokenizer.json")
    enc = {
        "pretrain": encode_text_files(tok, [str(d / "pretrain.txt")], str(d / "pretrain.bin")),
        "pretrain_heldout": encode_text_files(tok, [str(d / "heldout.txt")], str(d / "pretrain_heldout.bin")),
        "tune": encode_dialog_files(tok, [_jsonl(d / "tune.jsonl", DIALOGS)], str(d / "tune.bin"), 32),
        "tune_heldout": encode_dialog_files(tok, [_jsonl(d / "heldout.jsonl", HELDOUT)], str(d / "tune_heldout.bin"),
                                            32),
    }
    assert enc["tune"]["n_tokens"] > 0
    run_stage("pretrain", str(d / "pretrain.bin"), {**TRAIN, "steps": 30}, str(d / "pre.ckpt"), str(d / "pre.csv"),
              model={**TINY, "vocab_size": tok.vocab_size}, tokenizer_hash=tok.hash())
    tune = {**TRAIN, "steps": 150, "epochs": 0, "batch_size": 3, "min_lr": 3e-3}
    run_stage("tune", str(d / "tune.bin"), tune, str(d / "tune.ckpt"), str(d / "tune.csv"), init_ckpt=str(d / "pre.ckpt"))
    return d, tok


def evaluate(d, out, **settings):
    return run_evaluate(
        str(d / "pre.ckpt"), str(d / "tune.ckpt"), str(d / "tokenizer.json"), str(d / "pretrain_heldout.bin"),
        str(d / "tune_heldout.bin"), read_dialogs([str(d / "tune.jsonl")]), read_dialogs([str(d / "heldout.jsonl")]),
        str(d / "pre.csv"), str(d / "tune.csv"), settings, str(out),
    )


def test_exact_match_scoring():
    assert exact_match("  Hi!\n", "Hi!")
    assert exact_match("Hi!", " Hi! ")
    assert not exact_match("Hi", "Hi!")
    assert not exact_match("hi!", "Hi!")
    assert not exact_match("Hi! Hi!", "Hi!")
    assert score(["Hi!", "no", " Four. "], ["Hi!", "yes", "Four."]) == {"matches": 2, "total": 3, "rate": 2 / 3}
    assert score([], []) == {"matches": 0, "total": 0, "rate": 0.0}
    with pytest.raises(ValueError):
        score(["a"], [])


def test_text_batches_predict_every_token_once():
    ids = np.arange(23)
    batches = list(text_batches(ids, T=5, B=3))
    targets = np.concatenate([t.ravel() for _, t, _ in batches])
    assert np.array_equal(targets, np.arange(1, 23))
    assert [t.shape for t, _, _ in batches] == [(3, 5), (1, 5), (1, 2)]
    for tokens, tgt, mask in batches:
        assert np.array_equal(tgt, tokens + 1) and mask.all()


def test_run_evaluate_writes_report(stages, tmp_path):
    d, tok = stages
    m = evaluate(d, tmp_path, max_tokens=8, batch_size=2)
    for name in ("metrics.json", "report.md", "loss_pretrain.png", "loss_tune.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert not list(tmp_path.glob("*.tmp"))
    assert json.loads((tmp_path / "metrics.json").read_text()) == json.loads(json.dumps(m))
    assert (tmp_path / "loss_tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert set(m) >= {"model", "num_params", "heldout", "forgetting", "exact_match", "answers", "training", "settings"}
    for name in ("pretrain", "tune"):
        h = m["heldout"][name]
        assert h["tokens"] > 0
        for label in ("pretrained", "tuned"):
            assert h[f"ppl_{label}"] == pytest.approx(math.exp(h[f"loss_{label}"]))
    pre = m["heldout"]["pretrain"]
    assert m["forgetting"] == pytest.approx(pre["loss_tuned"] - pre["loss_pretrained"])
    # 150 steps on three dialogs: the tuned model has learned to answer them
    assert m["exact_match"]["tune"]["matches"] >= 2, m["answers"]["tune"]
    assert m["training"]["pretrain"]["steps"] == 30 and m["training"]["tune"]["steps"] == 150

    for name, dialogs in (("tune", DIALOGS), ("heldout", HELDOUT)):
        answers = m["answers"][name]
        assert [a["user"] for a in answers] == [x["user"] for x in dialogs]
        assert all(a["tokens"] <= 8 for a in answers)
        assert m["exact_match"][name] == score([a["answer"] for a in answers], [x["assistant"] for x in dialogs])
    report = (tmp_path / "report.md").read_text()
    assert "What is two plus two?" in report and "Say hello." in report and "Forgetting" in report


def test_heldout_loss_matches_reference(stages, tmp_path):
    """Token-weighted held-out loss over windows of the pretrain seq_len, against float64 numpy."""
    d, _ = stages
    m = evaluate(d, tmp_path, max_tokens=1, batch_size=3)
    ck = load_checkpoint(str(d / "pre.ckpt"))
    ids, _ = load_encoded(str(d / "pretrain_heldout.bin"))
    total, count = 0.0, 0
    for tokens, targets, mask in text_batches(ids, TRAIN["seq_len"], 3):
        loss, _ = reference.gpt_forward(ck["params"], ck["cfg"], tokens, targets, mask)
        total, count = total + loss * mask.sum(), count + mask.sum()
    assert m["heldout"]["pretrain"]["tokens"] == len(ids) - 1
    assert m["heldout"]["pretrain"]["loss_pretrained"] == pytest.approx(total / count, rel=1e-4)


def test_exact_match_counts_generated_answers(stages, tmp_path, monkeypatch):
    """A generator that answers the first tune prompt right (with stray spaces) and the rest wrong."""
    import clgpt.generate

    d, tok = stages
    right = {tuple(tok.encode(DIALOGS[0]["user"]))}

    class FakeGenerator:
        def __init__(self, cfg, params, device=None):
            pass

        def generate(self, prompt_ids, max_tokens, greedy=False, stop_ids=(), **sampling):
            if not greedy:  # the sampled continuations of held-out text
                return [(i, 0.5) for i in tok.encode(" sampled")]
            assert stop_ids == (tok.eos_id,)
            user = tuple(prompt_ids[2:-1])
            text = " " + DIALOGS[0]["assistant"] + " " if user in right else "wrong"
            return [(i, 0.5) for i in tok.encode(text)]

    monkeypatch.setattr(clgpt.generate, "Generator", FakeGenerator)
    m = evaluate(d, tmp_path)
    assert m["exact_match"]["tune"] == {"matches": 1, "total": 3, "rate": 1 / 3}
    assert m["exact_match"]["heldout"] == {"matches": 0, "total": 1, "rate": 0.0}
    assert [a["match"] for a in m["answers"]["tune"]] == [True, False, False]


def test_moe_model_reports_expert_usage(stages, tmp_path):
    d, tok = stages
    moe = {**TINY, "arch": "llama", "n_expert": 4, "n_expert_used": 2, "vocab_size": tok.vocab_size}
    run_stage("pretrain", str(d / "pretrain.bin"), {**TRAIN, "steps": 4}, str(tmp_path / "pre.ckpt"),
              str(tmp_path / "pre.csv"), model=moe, tokenizer_hash=tok.hash())
    run_stage("tune", str(d / "tune.bin"), {**TRAIN, "steps": 4, "batch_size": 3}, str(tmp_path / "tune.ckpt"),
              str(tmp_path / "tune.csv"), init_ckpt=str(tmp_path / "pre.ckpt"))
    m = run_evaluate(
        str(tmp_path / "pre.ckpt"), str(tmp_path / "tune.ckpt"), str(d / "tokenizer.json"),
        str(d / "pretrain_heldout.bin"), str(d / "tune_heldout.bin"), read_dialogs([str(d / "tune.jsonl")]),
        read_dialogs([str(d / "heldout.jsonl")]), str(tmp_path / "pre.csv"), str(tmp_path / "tune.csv"),
        {"max_tokens": 4}, str(tmp_path / "eval"),
    )
    usage = np.array(m["expert_usage"])
    assert usage.shape == (1, 4)
    assert np.allclose(usage.sum(axis=1), 2.0, atol=1e-3)  # each token goes to n_expert_used experts
    assert "Expert usage" in (tmp_path / "eval" / "report.md").read_text()
