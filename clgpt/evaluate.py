"""The evaluate stage: held-out loss and perplexity of both checkpoints on both held-out sets (so the
forgetting the tune stage causes shows), greedy answers with exact-match rates, the loss curves, and a
Markdown report.

Held-out text is cut into consecutive windows of the pretrain stage's seq_len (every token predicted
once); held-out dialogs count the reply and its `</s>` only, as in training. Losses are means over all
counted tokens, perplexity is exp(loss). forgetting = pretrain held-out loss of the tuned model minus
that of the pretrained one.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from clgpt.atomic import atomic_path, write_text_atomic
from clgpt.chat import encode_prompt
from clgpt.checkpoint import load_checkpoint
from clgpt.config import section_settings
from clgpt.data import load_encoded
from clgpt.errors import ClgptError
from clgpt.model import num_params
from clgpt.train import SMOOTHING, _resolve_device, dialog_rows, pad_dialogs

def eval_settings(settings: dict) -> dict:
    """The evaluate section with the schema's defaults filled in and checked."""
    return section_settings("evaluate", settings)


# ---- scoring -----------------------------------------------------------------------------------

def exact_match(answer: str, expected: str) -> bool:
    """An answer matches when it equals the expected reply after stripping surrounding whitespace."""
    return answer.strip() == expected.strip()


def score(answers: list[str], expected: list[str]) -> dict:
    """{"matches", "total", "rate"}; rate is 0.0 for no prompts."""
    if len(answers) != len(expected):
        raise ValueError(f"{len(answers)} answers for {len(expected)} expected replies")
    matches = sum(exact_match(a, e) for a, e in zip(answers, expected))
    return {"matches": matches, "total": len(expected), "rate": matches / len(expected) if expected else 0.0}


# ---- held-out loss -----------------------------------------------------------------------------

def text_batches(ids: np.ndarray, T: int, B: int):
    """Consecutive windows covering the stream once: rows of T tokens predicting the next T, batched
    by B; a last shorter window for the remainder. Yields tokens, targets int32 (B', T'), mask."""
    n_windows = (len(ids) - 1) // T
    for b0 in range(0, n_windows, B):
        windows = range(b0, min(b0 + B, n_windows))
        rows = np.stack([np.asarray(ids[w * T : w * T + T + 1], dtype=np.int32) for w in windows])
        yield rows[:, :-1], rows[:, 1:], np.ones((len(rows), T), dtype=np.float32)
    rest = len(ids) - 1 - n_windows * T
    if rest > 0:
        row = np.asarray(ids[n_windows * T :], dtype=np.int32)[None, :]
        yield row[:, :-1], row[:, 1:], np.ones((1, rest), dtype=np.float32)


def dialog_batches(rows: list, T: int, B: int):
    for b0 in range(0, len(rows), B):
        tokens, targets, mask, _ = pad_dialogs(rows[b0 : b0 + B], T)
        yield tokens, targets, mask


def mean_loss(eng, batches, usage: np.ndarray | None = None) -> tuple[float, int]:
    """Token-weighted mean loss over batches (Engine.forward returns each batch's masked mean).
    With `usage` (an (L, E) array, mixture-of-experts models), add each batch's expert usage, weighted
    like its loss."""
    total, count = 0.0, 0
    for tokens, targets, mask in batches:
        n = float(mask.sum())
        if n:
            total += float(eng.forward(tokens, targets, mask)) * n
            count += int(n)
            if usage is not None:
                usage += eng.expert_usage() * n
    return (total / count if count else float("nan")), count


# ---- logs and plots ----------------------------------------------------------------------------

def read_log(path: str):
    import pandas as pd

    try:
        return pd.read_csv(path)
    except (OSError, ValueError) as e:
        raise ClgptError(f"{path}: cannot read the training log ({e}); re-run the training stage") from None


def plot_loss(log, title: str, heldout: float | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if len(log):
        ax.plot(log["step"], log["loss"], lw=0.8, alpha=0.4, label="loss (batch)")
        ax.plot(log["step"], log["loss"].ewm(alpha=1 - SMOOTHING, adjust=False).mean(), lw=1.5, label="loss (smoothed)")
    else:
        ax.text(0.5, 0.5, "no steps logged", ha="center", va="center", transform=ax.transAxes)
    if heldout is not None and math.isfinite(heldout):
        ax.axhline(heldout, color="k", ls="--", lw=1, label=f"held-out {heldout:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)


def _train_summary(log) -> dict:
    if not len(log):
        return {"steps": 0, "final_loss": None, "elapsed_s": 0.0}
    last = log.iloc[-1]
    return {"steps": int(last["step"]), "final_loss": float(last["loss"]), "elapsed_s": float(last["elapsed_s"])}


# ---- the report --------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or " "


def _fmt(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"


def report_markdown(m: dict) -> str:
    h, em = m["heldout"], m["exact_match"]
    lines = [
        "# clgpt evaluation",
        "",
        f"Model: {m['model']['n_layer']} layers, {m['model']['n_embd']} channels, {m['model']['n_head']} heads, "
        f"vocabulary {m['model']['vocab_size']}, context {m['model']['n_ctx']}: {m['num_params']:,} parameters.",
        "",
        "## Held-out loss",
        "",
        "| held-out set | tokens | pretrained: loss | perplexity | tuned: loss | perplexity |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("pretrain", "tune"):
        r = h[name]
        lines.append(f"| {name} | {r['tokens']} | {_fmt(r['loss_pretrained'])} | {_fmt(r['ppl_pretrained'])} | "
                     f"{_fmt(r['loss_tuned'])} | {_fmt(r['ppl_tuned'])} |")
    forgetting = "n/a" if m["forgetting"] is None else f"{m['forgetting']:+.4f}"
    lines += [
        "",
        f"Forgetting (pretrain held-out loss after tune minus before): {forgetting}",
        "",
        "## Training",
        "",
        "| stage | steps | final loss | seconds |",
        "| --- | ---: | ---: | ---: |",
    ]
    for stage in ("pretrain", "tune"):
        t = m["training"][stage]
        lines.append(f"| {stage} | {t['steps']} | {_fmt(t['final_loss'])} | {t['elapsed_s']:.1f} |")
    lines += ["", "![pretrain loss](loss_pretrain.png)", "", "![tune loss](loss_tune.png)", ""]
    if "expert_usage" in m:
        n_expert = len(m["expert_usage"][0])
        lines += [
            "## Expert usage (tuned model, held-out tokens)",
            "",
            "Share of tokens routed to each expert; a row sums to the experts used per token. "
            "An expert near 0 has collapsed.",
            "",
            "| layer | " + " | ".join(f"expert {e}" for e in range(n_expert)) + " |",
            "| --- |" + " ---: |" * n_expert,
        ]
        for i, row in enumerate(m["expert_usage"]):
            lines.append(f"| {i} | " + " | ".join(f"{u:.3f}" for u in row) + " |")
        lines.append("")
    titles = {"tune": "Answers to the tune prompts", "heldout": "Answers to held-out prompts"}
    for name in ("tune", "heldout"):
        s = em[name]
        lines += [
            f"## {titles[name]} (greedy, at most {m['settings']['max_tokens']} tokens)",
            "",
            f"Exact match: {s['matches']}/{s['total']} ({100 * s['rate']:.1f}%)",
            "",
            "| | prompt | expected | answer |",
            "| --- | --- | --- | --- |",
        ]
        for a in m["answers"][name]:
            mark = "✓" if a["match"] else "✗"
            lines.append(f"| {mark} | {_cell(a['user'])} | {_cell(a['expected'])} | {_cell(a['answer'])} |")
        lines.append("")
    return "\n".join(lines)


# ---- the stage ---------------------------------------------------------------------------------

def run_evaluate(
    pretrain_ckpt: str,
    tune_ckpt: str,
    tokenizer_path: str,
    pretrain_heldout: str,
    tune_heldout: str,
    tune_dialogs: list[dict],
    heldout_dialogs: list[dict],
    pretrain_log_csv: str,
    tune_log_csv: str,
    settings: dict,
    out_dir: str,
    device=None,
) -> dict:
    """Write out_dir/metrics.json, report.md, loss_pretrain.png, loss_tune.png (each atomically);
    return the metrics. Dialogs are {"user", "assistant"} dicts (extra keys are ignored)."""
    from clgpt.engine import make_engine
    from clgpt.generate import Generator
    from clgpt.tokenizer import Tokenizer

    s = eval_settings(settings)
    tok = Tokenizer.load(tokenizer_path)
    pre, tuned = load_checkpoint(pretrain_ckpt), load_checkpoint(tune_ckpt)
    cfg = tuned["cfg"]
    if pre["cfg"] != cfg:
        raise ClgptError(f"{tune_ckpt}: model shape differs from {pretrain_ckpt}; re-run the tune stage")
    for path, ck in ((pretrain_ckpt, pre), (tune_ckpt, tuned)):
        h = ck["extra"].get("tokenizer_hash")
        if h and h != tok.hash():
            raise ClgptError(f"{path}: trained with another tokenizer than {tokenizer_path}; re-run the pipeline")
    dev = _resolve_device(device)

    text_ids, text_meta = load_encoded(pretrain_heldout)
    dialog_ids, dialog_meta = load_encoded(tune_heldout)
    for path, meta in ((pretrain_heldout, text_meta), (tune_heldout, dialog_meta)):
        if meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tok.hash():
            raise ClgptError(f"{path}: encoded with another tokenizer than {tokenizer_path}; re-run the encode stage")
    T_text = min(int(pre["extra"].get("settings", {}).get("seq_len", cfg.n_ctx)), cfg.n_ctx)
    rows, _ = dialog_rows(dialog_ids, dialog_meta, tune_heldout, cfg.n_ctx)
    T_dialog = max((min(len(doc) - 1, cfg.n_ctx) for doc, _ in rows), default=1)
    B = s["batch_size"]

    print(f"evaluate: held-out loss of {pretrain_ckpt} and {tune_ckpt}", file=sys.stderr)
    eng = make_engine(cfg, pre["params"], batch_size=B, seq_len=max(T_text, T_dialog), device=dev)
    heldout = {"pretrain": {}, "tune": {}}
    usage = np.zeros((cfg.n_layer, cfg.n_expert)) if getattr(cfg, "n_expert", 0) else None
    usage_tokens = 0
    for label, ck in (("pretrained", pre), ("tuned", tuned)):
        eng.set_params(ck["params"])
        for name, batches in (("pretrain", lambda: text_batches(text_ids, T_text, B)),
                              ("tune", lambda: dialog_batches(rows, cfg.n_ctx, B))):
            loss, count = mean_loss(eng, batches(), usage if label == "tuned" else None)
            usage_tokens += count if label == "tuned" else 0
            ok = math.isfinite(loss)
            heldout[name].update({"tokens": count, f"loss_{label}": loss if ok else None,
                                  f"ppl_{label}": math.exp(min(loss, 700.0)) if ok else None})
    del eng
    lp, lt = heldout["pretrain"]["loss_pretrained"], heldout["pretrain"]["loss_tuned"]
    forgetting = lt - lp if lp is not None and lt is not None else None

    gen = Generator(cfg, tuned["params"], device=dev)
    answers, exact = {}, {}
    for name, dialogs in (("tune", tune_dialogs), ("heldout", heldout_dialogs)):
        out = []
        for i, d in enumerate(dialogs):
            reply = gen.generate(encode_prompt(tok, d["user"]), s["max_tokens"], greedy=True, stop_ids=(tok.eos_id,))
            answer = tok.decode([t for t, _ in reply])
            out.append({"user": d["user"], "expected": d["assistant"], "answer": answer,
                        "match": exact_match(answer, d["assistant"]), "tokens": len(reply)})
            print(f"evaluate: {name} answer {i + 1}/{len(dialogs)}", file=sys.stderr, end="\r")
        answers[name] = out
        exact[name] = score([a["answer"] for a in out], [a["expected"] for a in out])
    print(file=sys.stderr)

    logs = {"pretrain": read_log(pretrain_log_csv), "tune": read_log(tune_log_csv)}
    metrics = {
        "model": json.loads(cfg.to_json()),
        "num_params": num_params(cfg),
        "heldout": heldout,
        "forgetting": forgetting,
        "exact_match": exact,
        "answers": answers,
        "training": {stage: _train_summary(log) for stage, log in logs.items()},
        "settings": s,
    }
    if usage is not None:
        # share of held-out tokens routed to each expert by the tuned model: (L, E), rows sum to n_expert_used
        metrics["expert_usage"] = (usage / max(usage_tokens, 1)).round(4).tolist()

    os.makedirs(out_dir, exist_ok=True)
    for stage, label in (("pretrain", "loss_pretrained"), ("tune", "loss_tuned")):
        plot_loss(logs[stage], stage, heldout[stage][label], os.path.join(out_dir, f"loss_{stage}.png"))

    write_text_atomic(os.path.join(out_dir, "report.md"), report_markdown(metrics))
    write_text_atomic(os.path.join(out_dir, "metrics.json"),
                      json.dumps(metrics, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    print(f"evaluate: tune exact match {exact['tune']['matches']}/{exact['tune']['total']}, held-out "
          f"{exact['heldout']['matches']}/{exact['heldout']['total']}; forgetting "
          f"{'n/a' if forgetting is None else f'{forgetting:+.4f}'}", file=sys.stderr)
    return metrics
