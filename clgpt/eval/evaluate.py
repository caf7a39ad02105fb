"""The evaluate stage: held-out loss and perplexity of both checkpoints on both held-out sets (so the
forgetting the tune stage causes shows), greedy answers to every assistant turn with exact-match rates
(overall and per turn: first reply, first reply after a system prompt, later replies), the loss curves,
and a Markdown report. Without a tune stage: the pretrained model only.

Text models: the held-out text loss is also given in nats per byte (total nats over the UTF-8 bytes of
the predicted tokens; special tokens have none), comparable across vocabularies and with
character-level results, and the report shows a few sampled continuations of held-out text.

Held-out text is cut into consecutive windows of the pretrain stage's seq_len (every token predicted
once); held-out dialogs count the replies and their `<|im_end|>` only, as in training. Losses are means over all
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
from clgpt.config import section_settings
from clgpt.device.knobs import Knobs
from clgpt.io.checkpoint import load_checkpoint
from clgpt.data import PAD_WIDTH, dialog_batches, dialog_rows, load_encoded, text_batches  # noqa: F401 (re-exported)
from clgpt.errors import ClgptError
from clgpt.model import num_params
from clgpt.training.train import SMOOTHING
from clgpt.eval.accept import accept_markdown, accept_scores, load_accept
from clgpt.eval.answers import (TURN_KINDS, cell, dialog_answers, evenly_spaced, exact_match,  # noqa: F401
                                greedy_answers, sample_note, score, system_heldout_answers, system_heldout_markdown,
                                system_summary)
from clgpt.eval.units import (batch_bytes, bits_per_byte_markdown, documents, heldout_bits_per_byte, tokenizer_markdown,
                         tokenizer_report)

N_SAMPLES = 3  # sampled continuations of held-out text in the report
SAMPLE_PROMPT_TOKENS = 32
SAMPLE_SEED = 1234

def eval_settings(settings: dict) -> dict:
    """The evaluate section with the schema's defaults filled in and checked."""
    return section_settings("evaluate", settings)


# ---- held-out loss -----------------------------------------------------------------------------

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

def read_log(path: str) -> dict:
    """A training log (log.csv) as {column: float64 array}, a blank cell NaN (val_loss between evaluations).
    Read with the csv module: pandas' import alone took a tenth of this stage on the character recipe."""
    import csv

    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows or "step" not in rows[0] or "loss" not in rows[0]:
            raise ValueError("no header with step and loss")
        head, body = rows[0], rows[1:]
        return {h: np.array([float(r[i]) if i < len(r) and r[i] != "" else math.nan for r in body], dtype=np.float64)
                for i, h in enumerate(head)}
    except (OSError, ValueError) as e:
        raise ClgptError(f"{path}: cannot read the training log ({e}); re-run the training stage") from None


def _smoothed(x: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average y[t] = (1 - alpha) y[t-1] + alpha x[t], y[0] = x[0] (pandas' ewm, adjust=False)."""
    y, acc = np.empty_like(x), math.nan
    for t, v in enumerate(x):
        if not math.isnan(v):  # a missing value carries the average on
            acc = v if math.isnan(acc) else (1 - alpha) * acc + alpha * v
        y[t] = acc
    return y


def _has_val(log: dict) -> bool:
    return "val_loss" in log and bool(np.isfinite(log["val_loss"]).any())


def _resolve_device(device):
    if device is None or isinstance(device, str):
        from clgpt.device.opencl import get_device

        return get_device(device or None)
    return device


def token_byte_lengths(tok) -> np.ndarray:
    """(V,) int64: the UTF-8 bytes each token stands for; 0 for the special tokens."""
    n_normal = tok.bos_id
    return np.array([len(tok.token_bytes(i)) if i < n_normal else 0 for i in range(tok.vocab_size)], dtype=np.int64)


def text_bytes(ids: np.ndarray, byte_lengths: np.ndarray) -> int:
    """Bytes of the tokens text_batches predicts (every token but the first)."""
    total = 0
    for a in range(1, len(ids), 1 << 22):
        total += int(byte_lengths[np.asarray(ids[a : a + (1 << 22)], dtype=np.int64)].sum())
    return total


def plot_loss(log, title: str, heldout: float | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = len(log["step"])
    if steps:
        ax.plot(log["step"], log["loss"], lw=0.8, alpha=0.4, label="loss (batch)")
        ax.plot(log["step"], _smoothed(log["loss"], 1 - SMOOTHING), lw=1.5, label="loss (smoothed)")
        if _has_val(log):
            val = np.isfinite(log["val_loss"])
            ax.plot(log["step"][val], log["val_loss"][val], "o-", lw=1.5, ms=3, label="held-out loss (during training)")
    else:
        ax.text(0.5, 0.5, "no steps logged", ha="center", va="center", transform=ax.transAxes)
    if heldout is not None and math.isfinite(heldout):
        ax.axhline(heldout, color="k", ls="--", lw=1, label=f"held-out {heldout:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    if steps and _has_val(log):
        top = max(float(np.nanmax(log["loss"][min(steps - 1, 10):])), float(np.nanmax(log["val_loss"])))
        ax.set_ylim(top=top * 1.05)  # the first steps' loss would flatten the rest
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)


def _median(log: dict, column: str) -> float | None:
    """The median of a log column's filled cells (tokens/s and MFU of every step), None if it has none."""
    a = log.get(column)
    a = a[np.isfinite(a)] if a is not None else []
    return float(np.median(a)) if len(a) else None


def _train_summary(log: dict) -> dict:
    if not len(log["step"]):
        return {"steps": 0, "final_loss": None, "elapsed_s": 0.0, "tokens_per_s": None, "mfu": None}
    return {"steps": int(log["step"][-1]), "final_loss": float(log["loss"][-1]),
            "elapsed_s": float(log["elapsed_s"][-1]) if "elapsed_s" in log else 0.0,
            "tokens_per_s": _median(log, "tokens_per_s"), "mfu": _median(log, "mfu")}


# ---- the report --------------------------------------------------------------------------------

def _fmt(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"


def report_markdown(m: dict) -> str:
    h, em = m["heldout"], m["exact_match"]
    tuned = m["tuned"]
    lines = [
        "# clgpt evaluation",
        "",
        f"Model: {m['model']['n_layer']} layers, {m['model']['n_embd']} channels, {m['model']['n_head']} heads, "
        f"vocabulary {m['model']['vocab_size']}, context {m['model']['n_ctx']}: {m['num_params']:,} parameters.",
        "",
        "## Held-out loss",
        "",
    ]
    if tuned:
        lines += ["| held-out set | tokens | pretrained: loss | perplexity | tuned: loss | perplexity |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name in ("pretrain", "tune"):
            r = h[name]
            lines.append(f"| {name} | {r['tokens']} | {_fmt(r['loss_pretrained'])} | {_fmt(r['ppl_pretrained'])} | "
                         f"{_fmt(r['loss_tuned'])} | {_fmt(r['ppl_tuned'])} |")
    else:
        r = h["pretrain"]
        lines += ["| held-out set | tokens | loss (nats/token) | perplexity |", "| --- | ---: | ---: | ---: |",
                  f"| text | {r['tokens']} | {_fmt(r['loss_pretrained'])} | {_fmt(r['ppl_pretrained'])} |"]
    r = h["pretrain"]
    label = "pretrained model" + (", tuned model" if tuned else "")
    npb = _fmt(r.get("nats_per_byte_pretrained")) + (f", {_fmt(r.get('nats_per_byte_tuned'))}" if tuned else "")
    lines += ["", f"Held-out text in nats per byte ({label}): {npb} over {r.get('bytes', 0):,} bytes "
              "(comparable across vocabularies and with character-level models).", ""]
    lines += bits_per_byte_markdown(m["bits_per_byte"], h)
    if tuned:
        forgetting = "n/a" if m["forgetting"] is None else f"{m['forgetting']:+.4f}"
        lines += [f"Forgetting (pretrain held-out loss after tune minus before): {forgetting}", ""]
    lines += tokenizer_markdown(m["tokenizer"])
    lines += ["## Training", "",
              "| stage | steps | final loss | best held-out loss (step) | seconds | tokens/s | MFU |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for stage in m["training"]:
        t = m["training"][stage]
        best = "n/a" if t.get("best_val_loss") is None else f"{t['best_val_loss']:.4f} ({t['best_step']})"
        tok_s = "n/a" if t.get("tokens_per_s") is None else f"{t['tokens_per_s']:,.0f}"
        mfu = "n/a" if t.get("mfu") is None else f"{100 * t['mfu']:.1f}%"
        lines.append(f"| {stage} | {t['steps']} | {_fmt(t['final_loss'])} | {best} | {t['elapsed_s']:.1f} | {tok_s} "
                     f"| {mfu} |")
    lines += ["", "tokens/s and MFU (model FLOPs utilisation: clgpt.model.flops_per_token against the device's peak in "
              "clgpt/device/peaks.py; n/a where no peak is known, as on CPUs) are medians over the steps.", ""]
    lines += [f"![{stage} loss](loss_{stage}.png)\n" for stage in m["training"]]
    if "expert_usage" in m:
        n_expert = len(m["expert_usage"][0])
        lines += [
            f"## Expert usage ({'tuned' if tuned else 'pretrained'} model, held-out tokens)",
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
    if m.get("samples"):
        lines += [f"## Sampled continuations of held-out text (temperature {m['sampling']['temperature']}, "
                  f"top-k {m['sampling']['top_k']}, seed {m['sampling']['seed']}, {m['settings']['max_tokens']} "
                  "tokens)", ""]
        for i, smp in enumerate(m["samples"], 1):
            lines += [f"**{i}.** prompt:", "", "```text", smp["prompt"], "```", "", "continuation:", "", "```text",
                      smp["continuation"], "```", ""]
    titles = {"tune": "Answers to the tune prompts", "heldout": "Answers to held-out prompts"}
    for name in ("tune", "heldout") if tuned else ():
        s = em[name]
        lines += [
            f"## {titles[name]} (greedy, at most {m['settings']['max_tokens']} tokens)",
            "",
            f"Exact match: {s['matches']}/{s['total']} ({100 * s['rate']:.1f}%){sample_note(s)}",
            "",
            "| first reply | first reply after a system prompt | 2nd and later replies |",
            "| ---: | ---: | ---: |",
            "| " + " | ".join(f"{t['matches']}/{t['total']} ({100 * t['rate']:.1f}%)"
                               for t in (s["by_turn"][k] for k in TURN_KINDS)) + " |",
            "",
            "| | turn | prompt | expected | answer |",
            "| --- | --- | --- | --- | --- |",
        ]
        for a in m["answers"][name]:
            mark = "✓" if a["match"] else "✗"
            turn = f"{a['turn']}" + (" (system)" if a["kind"] == "system" else "")
            lines.append(f"| {mark} | {turn} | {cell(a['user'])} | {cell(a['expected'])} | {cell(a['answer'])} |")
        lines.append("")
    lines += accept_markdown(m.get("acceptable"))
    lines += system_heldout_markdown(m)
    return "\n".join(lines)


def _samples(gen, tok, ids: np.ndarray, max_tokens: int, n_ctx: int) -> list[dict]:
    """N_SAMPLES continuations of held-out text, sampled: prompts of up to SAMPLE_PROMPT_TOKENS tokens
    (a quarter of the context) at evenly spaced places of the held-out stream; prompt + continuation stay
    within n_ctx, here the seq_len the model was trained on (positions past it are untrained)."""
    n_prompt = min(SAMPLE_PROMPT_TOKENS, n_ctx // 4)
    if len(ids) < n_prompt + 1:
        return []
    out = []
    for k in range(N_SAMPLES):
        at = int((len(ids) - n_prompt - 1) * (k + 0.5) / N_SAMPLES)
        prompt = [int(t) for t in ids[at : at + n_prompt]]
        reply = gen.generate(prompt, min(max_tokens, n_ctx - n_prompt), temperature=0.8, top_k=200,
                             seed=SAMPLE_SEED + k, stop_ids=(tok.eos_id,))
        out.append({"prompt": tok.decode(prompt), "continuation": tok.decode([t for t, _ in reply])})
    return out


# ---- the stage ---------------------------------------------------------------------------------

def run_evaluate(
    pretrain_ckpt: str,
    tune_ckpt: str | None,
    tokenizer_path: str,
    pretrain_heldout: str,
    tune_heldout: str | None,
    tune_dialogs: list[dict],
    heldout_dialogs: list[dict],
    pretrain_log_csv: str,
    tune_log_csv: str | None,
    settings: dict,
    out_dir: str,
    device=None,
    accept_path: str | None = None,
    *,
    knobs: Knobs,
) -> dict:
    """Write out_dir/metrics.json, report.md and a loss plot per stage (loss_pretrain.png, loss_tune.png
    when tuned), each atomically; return the metrics. Dialogs are {"messages": [...]} dicts as
    clgpt.data.read_dialogs gives them; every assistant turn is answered after the conversation before it.
    accept_path: the held-out prompts' acceptable replies (clgpt.eval.accept), or None.
    tune_ckpt None: no tune stage; the pretrained model is the one evaluated. knobs: the clgpt.device.knobs
    switches the stage read."""
    from clgpt.inference.generate import Generator
    from clgpt.models.factory import make_engine
    from clgpt.text.tokenizer import Tokenizer

    s = eval_settings(settings)
    tok = Tokenizer.load(tokenizer_path)
    tuned_run = tune_ckpt is not None
    pre = load_checkpoint(pretrain_ckpt)
    tuned = load_checkpoint(tune_ckpt) if tuned_run else pre
    cfg = tuned["cfg"]
    if pre["cfg"] != cfg:
        raise ClgptError(f"{tune_ckpt}: model shape differs from {pretrain_ckpt}; re-run the tune stage")
    for path, ck in ((pretrain_ckpt, pre), (tune_ckpt, tuned)) if tuned_run else ((pretrain_ckpt, pre),):
        h = ck["extra"].get("tokenizer_hash")
        if h and h != tok.hash():
            raise ClgptError(f"{path}: trained with another tokenizer than {tokenizer_path}; re-run the pipeline")
    rules = load_accept(accept_path, heldout_dialogs) if tuned_run and accept_path else None
    dev = _resolve_device(device)

    text_ids, text_meta = load_encoded(pretrain_heldout)
    heldouts = [(pretrain_heldout, text_meta)]
    rows: list = []
    if tuned_run:
        dialog_ids, dialog_meta = load_encoded(tune_heldout)
        heldouts.append((tune_heldout, dialog_meta))
        rows, _ = dialog_rows(dialog_ids, dialog_meta, tune_heldout, cfg.n_ctx)
    for path, meta in heldouts:
        if meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tok.hash():
            raise ClgptError(f"{path}: encoded with another tokenizer than {tokenizer_path}; re-run the encode stage")
    if len(text_ids) < 2:
        raise ClgptError(f"{pretrain_heldout}: the held-out text has {len(text_ids)} tokens; add held-out text")
    T_text = min(int(pre["extra"].get("settings", {}).get("seq_len", cfg.n_ctx)), cfg.n_ctx)
    longest = max((len(doc) - 1 for doc, _ in rows), default=1)
    T_dialog = min(-(-longest // PAD_WIDTH) * PAD_WIDTH, cfg.n_ctx)  # as pad_dialogs pads
    B = s["batch_size"]
    byte_lengths = token_byte_lengths(tok)
    n_bytes = text_bytes(text_ids, byte_lengths)

    print(f"evaluate: held-out loss of {pretrain_ckpt}" + (f" and {tune_ckpt}" if tuned_run else ""), file=sys.stderr)
    eng = make_engine(cfg, pre["params"], batch_size=B, seq_len=max(T_text, T_dialog), device=dev, knobs=knobs)
    heldout = {"pretrain": {}, "tune": {}} if tuned_run else {"pretrain": {}}
    usage = np.zeros((cfg.n_layer, cfg.n_expert)) if getattr(cfg, "n_expert", 0) else None
    usage_tokens = 0
    checkpoints = (("pretrained", pre), ("tuned", tuned)) if tuned_run else (("pretrained", pre),)
    last = checkpoints[-1][0]
    for label, ck in checkpoints:
        eng.set_params(ck["params"])
        sets = [("pretrain", lambda: text_batches(text_ids, T_text, B))]
        if tuned_run:
            sets.append(("tune", lambda: dialog_batches(rows, cfg.n_ctx, B)))
        for name, batches in sets:
            loss, count = mean_loss(eng, batches(), usage if label == last else None)
            usage_tokens += count if label == last else 0
            ok = math.isfinite(loss)
            heldout[name].update({"tokens": count, f"loss_{label}": loss if ok else None,
                                  f"ppl_{label}": math.exp(min(loss, 700.0)) if ok else None})
            if name == "pretrain":
                heldout[name].update({"bytes": n_bytes, f"nats_per_byte_{label}":
                                      loss * count / n_bytes if ok and n_bytes else None})
    del eng
    set_bytes = {"pretrain": n_bytes, **({"tune": batch_bytes(dialog_batches(rows, cfg.n_ctx, B), byte_lengths)}
                                         if tuned_run else {})}
    bpb = heldout_bits_per_byte(heldout, set_bytes, [label for label, _ in checkpoints])
    forgetting = None
    if tuned_run:
        lp, lt = heldout["pretrain"]["loss_pretrained"], heldout["pretrain"]["loss_tuned"]
        forgetting = lt - lp if lp is not None and lt is not None else None

    answers, exact = {}, {}
    gen = (make_engine(cfg, tuned["params"], batch_size=B, seq_len=cfg.n_ctx, device=dev, knobs=knobs)
           if tuned_run else None)
    asked = evenly_spaced(tune_dialogs, s["tune_sample"])  # the tune conversations answered
    for name, dialogs in (("tune", asked), ("heldout", heldout_dialogs)) if tuned_run else ():
        answers[name], exact[name] = dialog_answers(gen, tok, dialogs, s["max_tokens"], cfg.n_ctx, B, name)
    if tuned_run:
        exact["tune"].update(conversations=len(asked), of=len(tune_dialogs))
    if tuned_run:
        answers["system_heldout"], exact["system_heldout"] = system_heldout_answers(
            gen, tok, tune_dialogs, heldout_dialogs, s["max_tokens"], cfg.n_ctx, B, asked=asked)
    del gen
    print("evaluate: sampling continuations of held-out text", file=sys.stderr)
    samples = _samples(Generator(cfg, tuned["params"], device=dev, knobs=knobs), tok, text_ids,
                       s["max_tokens"], T_text)

    logs = {"pretrain": read_log(pretrain_log_csv)}
    if tuned_run:
        logs["tune"] = read_log(tune_log_csv)
    metrics = {
        "model": json.loads(cfg.to_json()),
        "num_params": num_params(cfg),
        "tuned": tuned_run,
        "heldout": heldout,
        "bits_per_byte": bpb,
        "tokenizer": tokenizer_report(tok, documents(tok, text_ids)),
        "forgetting": forgetting,
        "exact_match": exact,
        "acceptable": accept_scores(answers["heldout"], rules) if rules else None,
        "answers": answers,
        "samples": samples,
        "sampling": {"temperature": 0.8, "top_k": 200, "seed": SAMPLE_SEED},
        "training": {stage: {**_train_summary(log), **_best(log)} for stage, log in logs.items()},
        "settings": s,
    }
    if usage is not None:
        # share of held-out tokens routed to each expert by the final model: (L, E), rows sum to n_expert_used
        metrics["expert_usage"] = (usage / max(usage_tokens, 1)).round(4).tolist()

    os.makedirs(out_dir, exist_ok=True)
    for stage, label in (("pretrain", "loss_pretrained"), ("tune", "loss_tuned"))[: len(logs)]:
        plot_loss(logs[stage], stage, heldout[stage][label], os.path.join(out_dir, f"loss_{stage}.png"))

    write_text_atomic(os.path.join(out_dir, "report.md"), report_markdown(metrics))
    write_text_atomic(os.path.join(out_dir, "metrics.json"),
                      json.dumps(metrics, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    npb = heldout["pretrain"].get(f"nats_per_byte_{last}")
    summary = (f"evaluate: held-out text {_fmt(heldout['pretrain'][f'loss_{last}'])} nats/token, {_fmt(npb)} "
               f"nats/byte, {_fmt(bpb['pretrain'][last])} bits/byte")
    if tuned_run:
        by_turn = ", ".join(f"{k} {v['matches']}/{v['total']}" for k, v in exact["tune"]["by_turn"].items())
        summary += (f"; tune exact match {exact['tune']['matches']}/{exact['tune']['total']} ({by_turn}), held-out "
                    f"{exact['heldout']['matches']}/{exact['heldout']['total']}{system_summary(exact)}; forgetting "
                    f"{'n/a' if forgetting is None else f'{forgetting:+.4f}'}")
    if metrics["acceptable"]:
        ok = metrics["acceptable"]["all"]
        summary += f"; held-out replies acceptable {ok['matches']}/{ok['total']}"
    print(summary, file=sys.stderr)
    return metrics


def _best(log: dict) -> dict:
    """The best held-out loss logged during training, and its step (None when validation was off)."""
    if not _has_val(log):
        return {"best_val_loss": None, "best_step": None}
    i = int(np.nanargmin(np.where(np.isfinite(log["val_loss"]), log["val_loss"], np.nan)))
    return {"best_val_loss": float(log["val_loss"][i]), "best_step": int(log["step"][i])}
