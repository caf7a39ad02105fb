"""Greedy answers to dialogs and their exact-match scores: every assistant turn of a set of dialogs after the
conversation before it, the tune questions after the held-out system prompts, and an evenly spaced sample of
the tune conversations when answering all of them would cost more than the figure is worth.
"""

from __future__ import annotations

import sys

import numpy as np

from clgpt.data import PAD_WIDTH
from clgpt.text.chat import PARAGRAPH_WORDS, encode_prompt, heldout_systems, system_probes, turns

# ---- scoring -----------------------------------------------------------------------------------

def exact_match(answer: str, expected: str) -> bool:
    """An answer matches when it equals the expected reply after stripping surrounding whitespace."""
    return answer.strip() == expected.strip()


TURN_KINDS = ("first", "system", "later")  # see turn_kind


def turn_kind(history: list[dict]) -> str:
    """Which exact-match column a reply counts in: "first" (the first reply, no system prompt), "system"
    (the first reply after a system prompt) or "later" (the 2nd, 3rd, ... reply of a conversation)."""
    if any(m["role"] == "assistant" for m in history):
        return "later"
    return "system" if history[0]["role"] == "system" else "first"


def score(answers: list[str], expected: list[str]) -> dict:
    """{"matches", "total", "rate"}; rate is 0.0 for no prompts."""
    if len(answers) != len(expected):
        raise ValueError(f"{len(answers)} answers for {len(expected)} expected replies")
    matches = sum(exact_match(a, e) for a, e in zip(answers, expected))
    return {"matches": matches, "total": len(expected), "rate": matches / len(expected) if expected else 0.0}


# ---- greedy answers ----------------------------------------------------------------------------

def greedy_answers(eng, prompts: list[list[int]], max_tokens: int, stop_id: int, n_ctx: int, B: int,
                   desc: str = "answers") -> list[list[int]]:
    """Greedy replies (ids, without the stop id) to many prompts, B at a time: one prefill of the batch's rows
    padded to a multiple of PAD_WIDTH (causal attention: padding after a row's last token changes none of its
    logits), then one token a row and step against the key/value cache (clgpt.inference.kvcache), each row at its own
    position. Stops a row as clgpt.inference.generate.Generator does: at the stop id, after max_tokens, or when it fills
    n_ctx."""
    from tqdm import tqdm

    from clgpt.inference.kvcache import KVCache

    cache = KVCache(eng)
    # batch prompts of similar length together (less padding); answers come back in the given order
    order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
    out = [[] for _ in prompts]
    for b0 in tqdm(range(0, len(prompts), B), desc=desc, unit="batch", file=sys.stderr, dynamic_ncols=True):
        idx = order[b0 : b0 + B]
        rows = [list(prompts[k][-n_ctx:]) for k in idx]
        live = [len(r) < n_ctx and max_tokens > 0 for r in rows]
        if not any(live):
            continue
        W = min(-(-max(len(r) for r in rows) // PAD_WIDTH) * PAD_WIDTH, n_ctx)
        tokens = np.zeros((len(rows), W), dtype=np.int32)  # (rows, W)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        logits = cache.prefill(tokens, [len(r) - 1 for r in rows])  # (rows, V)
        while True:
            for i, r in enumerate(rows):
                if not live[i]:
                    continue
                t = int(np.argmax(logits[i]))
                if t == stop_id:
                    live[i] = False
                    continue
                r.append(t)
                out[idx[i]].append(t)
                live[i] = len(out[idx[i]]) < max_tokens and len(r) < n_ctx
            if not any(live):
                break
            # finished rows ride along on their last token and position, unread
            logits = cache.step([r[-1] for r in rows], [min(len(r), n_ctx) - 1 for r in rows])
    return out


def dialog_answers(gen, tok, dialogs: list[dict], max_tokens: int, n_ctx: int, B: int, name: str) -> tuple[list, dict]:
    """Greedy answers to every assistant turn of the dialogs, each after the conversation before it as written
    (the expected earlier replies); -> the answers, and their exact-match score with one per TURN_KINDS."""
    probes = [(history, reply) for d in dialogs for history, reply in turns(d["messages"])]
    replies = greedy_answers(gen, [encode_prompt(tok, h) for h, _ in probes], max_tokens, tok.im_end_id, n_ctx, B,
                             desc=f"{name} answers ({len(probes)} turns)")
    out = []
    for (history, expected), reply in zip(probes, replies):
        answer = tok.decode(reply)
        out.append({"user": history[-1]["content"], "turn": sum(m["role"] == "user" for m in history),
                    "kind": turn_kind(history), "expected": expected, "answer": answer,
                    "match": exact_match(answer, expected), "tokens": len(reply)})
    exact = score([a["answer"] for a in out], [a["expected"] for a in out])
    exact["by_turn"] = {kind: score([a["answer"] for a in out if a["kind"] == kind],
                                    [a["expected"] for a in out if a["kind"] == kind]) for kind in TURN_KINDS}
    return out, exact


def evenly_spaced(dialogs: list, n: int) -> list:
    """n of the dialogs, evenly spaced over the list (the files' order), first and last included; all of them
    when n is 0 or not below their number. A tune set of a few thousand conversations costs the evaluation more
    than the training of its default model; every k-th of them estimates its exact-match rate."""
    if not n or n >= len(dialogs):
        return dialogs
    return [dialogs[i] for i in np.unique(np.linspace(0, len(dialogs) - 1, n).round().astype(np.int64))]


def sample_note(exact: dict) -> str:
    """The report's note on a sampled exact-match figure ("" when every conversation was answered)."""
    n, of = exact.get("conversations"), exact.get("of")
    return "" if n is None or n == of else f" over {n} of the {of} tune conversations, evenly spaced (evaluate.tune_sample)"


# ---- tune questions after held-out system prompts ------------------------------------------------

def system_heldout_answers(gen, tok, tune_dialogs: list[dict], heldout_dialogs: list[dict], max_tokens: int,
                           n_ctx: int, B: int, asked: list[dict] | None = None) -> tuple[list[dict], dict]:
    """Greedy answers to the tune questions (single-turn tune dialogs) after the system prompts that only
    the held-out dialogs use (clgpt.text.chat.system_probes: as the first turn and as a later one, the earlier
    replies as written), and their exact-match rates {"all" | "paragraph" | "line": {"first", "later"}};
    paragraph: prompts of PARAGRAPH_WORDS words or more. ([], {}) when there are none. asked: the tune dialogs
    whose questions to ask (a sample of tune_dialogs; all of them when None)."""
    systems = heldout_systems(tune_dialogs, heldout_dialogs)
    pairs = [(d["messages"][0]["content"], d["messages"][1]["content"]) for d in (tune_dialogs if asked is None else asked)
             if [m["role"] for m in d["messages"]] == ["user", "assistant"]]
    if not systems or not pairs:
        return [], {}
    reply_to = dict(pairs)
    probes = system_probes(pairs, systems)
    conversations = [[*opening, *[m for q in questions[:-1] for m in ({"role": "user", "content": q},
                                                                      {"role": "assistant", "content": reply_to[q]})],
                      {"role": "user", "content": questions[-1]}] for _, opening, questions, _ in probes]
    replies = greedy_answers(gen, [encode_prompt(tok, c) for c in conversations], max_tokens, tok.im_end_id, n_ctx, B,
                             desc=f"held-out system prompts ({len(probes)} turns)")
    out = []
    for (kind, opening, questions, expected), reply in zip(probes, replies):
        answer = tok.decode(reply)
        out.append({"system": opening[0]["content"], "paragraph": len(opening[0]["content"].split()) >= PARAGRAPH_WORDS,
                    "user": questions[-1], "turn": len(questions), "kind": kind, "expected": expected,
                    "answer": answer, "match": exact_match(answer, expected)})
    rates = {length: {kind: score([a["answer"] for a in picked if a["kind"] == kind],
                                  [a["expected"] for a in picked if a["kind"] == kind]) for kind in ("first", "later")}
             for length, picked in (("all", out), ("paragraph", [a for a in out if a["paragraph"]]),
                                    ("line", [a for a in out if not a["paragraph"]]))}
    return out, {"prompts": len(systems), **rates}


def system_heldout_markdown(m: dict) -> list[str]:
    """The report's section on the tune questions after held-out system prompts (none without them)."""
    r = m["exact_match"].get("system_heldout")
    if not r:
        return []
    rate = lambda x: f"{x['matches']}/{x['total']} ({100 * x['rate']:.1f}%)"  # noqa: E731
    lines = [f"## Tune questions after held-out system prompts (greedy, at most {m['settings']['max_tokens']} tokens)",
             "", f"{r['prompts']} system prompts that no tune dialog uses, taken in turn; a paragraph has "
             f"{PARAGRAPH_WORDS} words or more. Earlier replies as written.", "",
             "| system prompts | first reply | 2nd or 3rd reply |", "| --- | ---: | ---: |"]
    for length, label in (("paragraph", "paragraph"), ("line", "one line"), ("all", "all")):
        lines.append(f"| {label} | {rate(r[length]['first'])} | {rate(r[length]['later'])} |")
    misses = [a for a in m["answers"]["system_heldout"] if not a["match"]]
    if misses:
        lines += ["", "| turn | system prompt | prompt | expected | answer |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {a['turn']} | {cell(a['system'][:40])}… | {cell(a['user'])} | {cell(a['expected'])} | "
                  f"{cell(a['answer'])} |" for a in misses]
    return lines + [""]



def cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or " "



def system_summary(exact: dict) -> str:
    r = exact.get("system_heldout")
    if not r:
        return ""
    p = r["paragraph"]
    return (f", after held-out paragraph system prompts first {p['first']['matches']}/{p['first']['total']}, "
            f"later {p['later']['matches']}/{p['later']['total']}")
