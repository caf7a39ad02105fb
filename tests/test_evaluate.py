"""The evaluate stage on a tiny pretrained + tuned model: files, metric keys, held-out loss against the
float64 reference, exact-match scoring."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from clgpt.data import encode_dialog_files, encode_text_files, load_encoded, read_dialogs
from clgpt.eval.evaluate import exact_match, run_evaluate, score, text_batches
from clgpt.io.checkpoint import load_checkpoint
from clgpt.models import reference
from clgpt.text.tokenizer import Tokenizer
from clgpt.training.train import run_stage
from clgpt.device.knobs import Knobs

TEXT = ["The cat sat on the mat.", "A dog ran in the park.", "The sun is warm today.", "Birds sing in the morning."]
DIALOGS = [
    {"user": "Say hi.", "assistant": "Hi!"},
    {"user": "Who are you?", "assistant": "A tiny model."},
    {"user": "What is two plus two?", "assistant": "Four."},
]
HELDOUT = [
    {"user": "Say hello.", "assistant": "Hello!"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Who are you?"},
                  {"role": "assistant", "content": "A tiny model."}]},
]
# (user, expected, kind) of each assistant turn of HELDOUT, in order
HELDOUT_TURNS = [("Say hello.", "Hello!", "first"), ("Say hi.", "Hi!", "system"), ("Who are you?", "A tiny model.", "later")]
TINY = {"n_ctx": 64, "n_embd": 16, "n_head": 2, "n_layer": 1, "n_ff": 32}
TRAIN = {"seed": 3, "batch_size": 4, "seq_len": 16, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2}
TUNE_SEQ = 48


def _jsonl(path, dialogs):
    path.write_text("".join(json.dumps(d) + "\n" for d in dialogs))
    return str(path)


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    (d / "pretrain.txt").write_text("\n".join(TEXT * 3) + "\n")
    (d / "heldout.txt").write_text("The cat ran in the sun.\nA bird sat on the dog.\n")
    tok = Tokenizer.train(TEXT + [t for x in DIALOGS for t in x.values()] + ["user\nassistant\n"] * 3, 300)
    tok.save(d / "tokenizer.json")
    enc = {
        "pretrain": encode_text_files(tok, [str(d / "pretrain.txt")], str(d / "pretrain.bin")),
        "pretrain_heldout": encode_text_files(tok, [str(d / "heldout.txt")], str(d / "pretrain_heldout.bin")),
        "tune": encode_dialog_files(tok, [_jsonl(d / "tune.jsonl", DIALOGS)], str(d / "tune.bin"), 64),
        "tune_heldout": encode_dialog_files(tok, [_jsonl(d / "heldout.jsonl", HELDOUT)], str(d / "tune_heldout.bin"),
                                            64),
    }
    assert enc["tune"]["n_tokens"] > 0
    run_stage("pretrain", str(d / "pretrain.bin"), {**TRAIN, "steps": 30}, str(d / "pre.ckpt"), str(d / "pre.csv"),
              model={**TINY, "vocab_size": tok.vocab_size}, tokenizer_hash=tok.hash())
    tune = {**TRAIN, "steps": 150, "epochs": 0, "batch_size": 3, "min_lr": 3e-3, "seq_len": TUNE_SEQ}
    run_stage("tune", str(d / "tune.bin"), tune, str(d / "tune.ckpt"), str(d / "tune.csv"), init_ckpt=str(d / "pre.ckpt"))
    return d, tok


def evaluate(d, out, **settings):
    return run_evaluate(
        str(d / "pre.ckpt"), str(d / "tune.ckpt"), str(d / "tokenizer.json"), str(d / "pretrain_heldout.bin"),
        str(d / "tune_heldout.bin"), read_dialogs([str(d / "tune.jsonl")]), read_dialogs([str(d / "heldout.jsonl")]),
        str(d / "pre.csv"), str(d / "tune.csv"), settings, str(out), knobs=Knobs()
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

    turns = {"tune": [(x["user"], x["assistant"], "first") for x in DIALOGS], "heldout": HELDOUT_TURNS}
    for name, expected in turns.items():
        answers = m["answers"][name]
        assert [(a["user"], a["expected"], a["kind"]) for a in answers] == expected
        assert all(a["tokens"] <= 8 for a in answers)
        em = m["exact_match"][name]
        assert {k: em[k] for k in ("matches", "total", "rate")} == score([a["answer"] for a in answers],
                                                                          [e for _, e, _ in expected])
        for kind, s in em["by_turn"].items():
            mine = [a for a in answers if a["kind"] == kind]
            assert s == score([a["answer"] for a in mine], [a["expected"] for a in mine]), kind
    assert [a["turn"] for a in m["answers"]["heldout"]] == [1, 1, 2]
    report = (tmp_path / "report.md").read_text()
    assert "What is two plus two?" in report and "Say hello." in report and "Forgetting" in report
    assert "2nd and later replies" in report


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
    """Answers that get the first tune prompt right (with stray spaces) and the rest wrong."""
    import clgpt.eval.answers

    d, tok = stages
    right = DIALOGS[0]["user"]

    def fake_answers(eng, prompts, max_tokens, stop_id, n_ctx, B, desc=""):
        assert stop_id == tok.im_end_id
        out = []
        for ids in prompts:
            prompt = tok.decode(ids)
            assert prompt.endswith("<|im_start|>assistant\n")
            last_user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
            out.append(tok.encode(" " + DIALOGS[0]["assistant"] + " " if last_user == right else "wrong"))
        return out

    monkeypatch.setattr(clgpt.eval.answers, "greedy_answers", fake_answers)
    m = evaluate(d, tmp_path)
    assert {k: m["exact_match"]["tune"][k] for k in ("matches", "total", "rate")} == {"matches": 1, "total": 3,
                                                                                      "rate": 1 / 3}
    assert m["exact_match"]["tune"]["by_turn"]["first"] == {"matches": 1, "total": 3, "rate": 1 / 3}
    # the held-out system-prompt turn asks "Say hi.", the tune question answered right
    assert m["exact_match"]["heldout"]["by_turn"] == {"first": {"matches": 0, "total": 1, "rate": 0.0},
                                                      "system": {"matches": 1, "total": 1, "rate": 1.0},
                                                      "later": {"matches": 0, "total": 1, "rate": 0.0}}
    assert [a["match"] for a in m["answers"]["tune"]] == [True, False, False]
    # the tune questions after "Be brief.", which only the held-out dialogs use (one line): "Say hi." is
    # right as the first turn and as the 2nd
    s = m["exact_match"]["system_heldout"]
    assert s["prompts"] == 1 and s["all"] == s["line"]
    assert s["line"] == {"first": {"matches": 1, "total": 3, "rate": 1 / 3},
                         "later": {"matches": 1, "total": 3, "rate": 1 / 3}}
    assert s["paragraph"]["first"]["total"] == 0 and s["paragraph"]["later"]["total"] == 0
    assert [(a["system"], a["user"], a["turn"], a["match"]) for a in m["answers"]["system_heldout"]] == [
        ("Be brief.", "Say hi.", 1, True), ("Be brief.", "Say hi.", 2, True),
        ("Be brief.", "Who are you?", 1, False), ("Be brief.", "Who are you?", 3, False),
        ("Be brief.", "What is two plus two?", 1, False), ("Be brief.", "What is two plus two?", 2, False)]
    report = (tmp_path / "report.md").read_text()
    assert "| one line | 1/3 (33.3%) | 1/3 (33.3%) |" in report and "| paragraph | 0/0 (0.0%) | 0/0 (0.0%) |" in report


def test_tune_sample_answers_evenly_spaced_conversations_and_says_so(stages, tmp_path, monkeypatch):
    """tune_sample 2 of the 3 tune dialogs: the first and the last are answered, and only their questions are
    asked after the held-out system prompt; the held-out dialogs are all answered; the report says so."""
    import clgpt.eval.answers

    d, tok = stages

    def fake_answers(eng, prompts, max_tokens, stop_id, n_ctx, B, desc=""):
        return [tok.encode("Hi!") for _ in prompts]

    monkeypatch.setattr(clgpt.eval.answers, "greedy_answers", fake_answers)
    m = evaluate(d, tmp_path, tune_sample=2)
    t = m["exact_match"]["tune"]
    assert [a["user"] for a in m["answers"]["tune"]] == [DIALOGS[0]["user"], DIALOGS[2]["user"]]
    assert (t["matches"], t["total"], t["conversations"], t["of"]) == (1, 2, 2, 3)
    assert m["exact_match"]["heldout"]["total"] == len(HELDOUT_TURNS)
    assert sorted({a["user"] for a in m["answers"]["system_heldout"]}) == sorted([DIALOGS[0]["user"], DIALOGS[2]["user"]])
    assert "Exact match: 1/2 (50.0%) over 2 of the 3 tune conversations, evenly spaced" in (tmp_path / "report.md").read_text()
    every = evaluate(d, tmp_path / "all", tune_sample=3)
    assert every["exact_match"]["tune"]["total"] == 3 and "evenly spaced" not in (tmp_path / "all" / "report.md").read_text()


def test_batched_greedy_answers_match_the_generator(stages):
    """greedy_answers (rows of different lengths in one padded batch) gives the Generator's greedy replies."""
    from clgpt.eval.evaluate import greedy_answers
    from clgpt.inference.generate import Generator
    from clgpt.models.factory import make_engine
    from clgpt.text.chat import encode_prompt

    d, tok = stages
    ck = load_checkpoint(str(d / "tune.ckpt"))
    cfg = ck["cfg"]
    prompts = [encode_prompt(tok, x["user"]) for x in DIALOGS] + [encode_prompt(tok, HELDOUT[1]["messages"][:4])]
    prompts.append([tok.bos_id, *tok.encode("The cat sat on the mat. " * 4)][: cfg.n_ctx - 2])  # fills n_ctx
    gen = Generator(cfg, ck["params"], knobs=Knobs())
    expected = [[t for t, _ in gen.generate(p, 8, greedy=True, stop_ids=(tok.im_end_id,))] for p in prompts]
    eng = make_engine(cfg, ck["params"], batch_size=3, seq_len=cfg.n_ctx, knobs=Knobs())
    assert greedy_answers(eng, prompts, 8, tok.im_end_id, cfg.n_ctx, 3) == expected
    assert len(expected[-1]) == 2  # stopped by the context


def test_moe_model_reports_expert_usage(stages, tmp_path):
    d, tok = stages
    moe = {**TINY, "arch": "llama", "n_expert": 4, "n_expert_used": 2, "vocab_size": tok.vocab_size}
    run_stage("pretrain", str(d / "pretrain.bin"), {**TRAIN, "steps": 4}, str(tmp_path / "pre.ckpt"),
              str(tmp_path / "pre.csv"), model=moe, tokenizer_hash=tok.hash())
    run_stage("tune", str(d / "tune.bin"), {**TRAIN, "steps": 4, "batch_size": 3, "seq_len": TUNE_SEQ},
              str(tmp_path / "tune.ckpt"),
              str(tmp_path / "tune.csv"), init_ckpt=str(tmp_path / "pre.ckpt"))
    m = run_evaluate(
        str(tmp_path / "pre.ckpt"), str(tmp_path / "tune.ckpt"), str(d / "tokenizer.json"),
        str(d / "pretrain_heldout.bin"), str(d / "tune_heldout.bin"), read_dialogs([str(d / "tune.jsonl")]),
        read_dialogs([str(d / "heldout.jsonl")]), str(tmp_path / "pre.csv"), str(tmp_path / "tune.csv"),
        {"max_tokens": 4}, str(tmp_path / "eval"), knobs=Knobs()
    )
    usage = np.array(m["expert_usage"])
    assert usage.shape == (1, 4)
    assert np.allclose(usage.sum(axis=1), 2.0, atol=1e-3)  # each token goes to n_expert_used experts
    assert "Expert usage" in (tmp_path / "eval" / "report.md").read_text()


ACCEPT = {"acts": {"greeting": ["hello", "привет"]},
          "prompts": {"Say hello.": {"act": "greeting"}, "Who are you?": {"has": ["tiny|small", "model"]}}}


def test_acceptable_reply_holds_the_act_or_every_fact():
    from clgpt.eval.accept import acceptable

    acts = ACCEPT["acts"]
    assert acceptable("Hello, friend!", {"act": "greeting"}, acts)
    assert acceptable("ПРИВЕТ!", {"act": "greeting"}, acts)  # case aside, in either language
    assert not acceptable("Bees make honey.", {"act": "greeting"}, acts)
    assert acceptable("A small model.", {"has": ["tiny|small", "model"]}, acts)
    assert not acceptable("A small dog.", {"has": ["tiny|small", "model"]}, acts)  # every entry must be there
    assert acceptable("Spiders have 8 legs.", {"has": ["eight|8"]}, acts)


def test_acceptable_reply_holds_each_phrase_from_a_word_start():
    """A phrase counts where a word starts (an inflected ending passes), and a number only whole: a word or a
    number inside another carries nothing."""
    from clgpt.eval.accept import acceptable

    acts = {"greeting": ["hello", "привет"], "farewell": ["bye"]}
    spider = {"has": ["восемь|8", "паук"]}
    assert acceptable("У паука восемь ног.", spider, acts)
    assert acceptable("У паука 8 ног.", spider, acts)
    assert not acceptable("У паука сто восемьдесят ног.", {"has": ["семь|7"]}, acts)  # "семь" inside "восемьдесят"
    assert not acceptable("У паука 180 ног.", spider, acts)  # 8 inside 180
    assert not acceptable("У паука 18 ног.", spider, acts)  # 8 ends 18, but 18 is not 8
    assert not acceptable("У осьминога восемь ног.", spider, acts)  # the number without what it counts
    assert acceptable("Столица Германии — Берлин.", {"has": ["Берлин"]}, acts)
    assert acceptable("Он живёт в Берлине.", {"has": ["Берлин"]}, acts)  # an inflected form
    assert acceptable("Goodbye, and bye!", {"act": "farewell"}, acts)
    assert not acceptable("Goodbye!", {"act": "farewell"}, acts)  # "bye" inside "goodbye"
    assert not acceptable("Othello.", {"act": "greeting"}, acts)


def test_acceptable_share_counts_the_replies_to_heldout_prompts(stages, tmp_path, monkeypatch):
    """Held-out answers to prompts of the rules file: not word for word, but acceptable, counted by language."""
    import clgpt.eval.answers

    d, tok = stages
    said = {"Say hello.": "Hello there, friend.", "Say hi.": "Hi!", "Who are you?": "I have no idea."}

    def fake_answers(eng, prompts, max_tokens, stop_id, n_ctx, B, desc=""):
        last = [tok.decode(ids).rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0] for ids in prompts]
        return [tok.encode(said.get(u, "wrong")) for u in last]

    monkeypatch.setattr(clgpt.eval.answers, "greedy_answers", fake_answers)
    (tmp_path / "accept.json").write_text(json.dumps(ACCEPT))
    m = run_evaluate(
        str(d / "pre.ckpt"), str(d / "tune.ckpt"), str(d / "tokenizer.json"), str(d / "pretrain_heldout.bin"),
        str(d / "tune_heldout.bin"), read_dialogs([str(d / "tune.jsonl")]), read_dialogs([str(d / "heldout.jsonl")]),
        str(d / "pre.csv"), str(d / "tune.csv"), {}, str(tmp_path), accept_path=str(tmp_path / "accept.json"),
        knobs=Knobs())
    r = m["acceptable"]
    # "Say hello." (first reply) passes by its act, "Who are you?" (later reply) fails; "Say hi." has no rule
    assert r["all"] == {"matches": 1, "total": 2, "rate": 0.5} and r["exact"]["matches"] == 0
    assert r["by_language"]["en"]["first"] == {"matches": 1, "total": 1, "rate": 1.0}
    assert r["by_language"]["en"]["later"] == {"matches": 0, "total": 1, "rate": 0.0}
    assert r["by_language"]["ru"]["all"]["total"] == 0
    assert r["prompts"] == {"Say hello.": {"acceptable": 1, "exact": 0, "total": 1},
                            "Who are you?": {"acceptable": 0, "exact": 0, "total": 1}}
    report = (tmp_path / "report.md").read_text()
    assert "Acceptable: 1/2 (50.0%)" in report and "| en | 1/2 (50.0%) |" in report


@pytest.mark.parametrize("rules, message", [
    ({"acts": {}, "prompts": {}}, "no acceptable reply for the held-out prompt 'Say hello.'"),
    ({"acts": {}, "prompts": {"Say hello.": {"act": "greeting"}}}, "act 'greeting' is not one of acts"),
    ({"acts": {"greeting": []}, "prompts": {}}, "acts.greeting: give a list of phrases"),
    ({"prompts": {}}, 'expected {"acts"'),
])
def test_bad_acceptable_replies_file_is_one_line_naming_it(tmp_path, rules, message):
    from clgpt.errors import ClgptError
    from clgpt.eval.accept import load_accept

    path = tmp_path / "accept.json"
    path.write_text(json.dumps(rules))
    heldout = [{"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]}]
    with pytest.raises(ClgptError) as e:
        load_accept(str(path), heldout)
    assert str(path) in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


def test_figures_script_counts_the_replies_of_the_first_heldout_dialogs(tmp_path, capsys):
    """bench/heldout_figures.py: word for word over the dialogs that ask only the first N held-out questions
    (their conversations included), and the tune replies to the questions of the named files."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "heldout_figures", Path(__file__).resolve().parent.parent / "bench" / "heldout_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    turn = lambda u, a: [{"role": "user", "content": u}, {"role": "assistant", "content": a}]  # noqa: E731
    heldout = tmp_path / "heldout.jsonl"
    dialogs = [turn("Old?", "A."), turn("New?", "B."), turn("Tune?", "C.") + turn("Old?", "A."),
               turn("Tune?", "C.") + turn("New?", "B.")]
    heldout.write_text("".join(json.dumps({"messages": m}) + "\n" for m in dialogs))
    written = tmp_path / "written.jsonl"
    written.write_text(json.dumps({"user": "Tune?", "assistant": "C."}) + "\n")
    # answers in the file's order: Old? right, New? wrong, (Tune? right, Old? wrong), (Tune? right, New? right)
    matches = [True, False, True, False, True, True]
    metrics = {"exact_match": {"tune": {"matches": 1, "total": 2}},
               "answers": {"heldout": [{"match": m} for m in matches],
                           "tune": [{"user": "Tune?", "match": True}, {"user": "Other?", "match": False}]}}
    assert mod.earlier_replies(metrics, str(heldout), 1) == (2, 3)
    (tmp_path / "m.json").write_text(json.dumps(metrics))
    assert mod.main([str(tmp_path / "m.json"), str(heldout), "--first", "1", "--written", str(written)]) == 0
    out = capsys.readouterr().out
    assert "first 1 dialogs word for word: 2/3" in out and f"{written} word for word: 1/1" in out
    metrics["answers"]["heldout"].append({"match": True})  # another held-out file's answers
    with pytest.raises(SystemExit, match="not the held-out file"):
        mod.earlier_replies(metrics, str(heldout), 1)
