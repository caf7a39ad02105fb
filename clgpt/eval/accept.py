"""Whether a reply gives a user what they asked for, beside word for word: the held-out prompts' acceptable
replies are defined in data, a JSON file (corpus.tune_accept, data/heldout/accept.json by default):

    {"acts": {"greeting": ["hello", "привет", ...], ...},
     "prompts": {"Hello!": {"act": "greeting"}, "What city is the capital of Italy?": {"has": ["Rome"]}, ...}}

A reply carries an act when it holds one of the act's phrases, and a fact when it holds, for each entry of
"has", one of the entry's alternatives (split at "|", e.g. "eight|8"); case is ignored. A phrase or alternative
counts where a word starts, so an inflected form passes ("Берлин" in "в Берлине") but a word inside another does
not ("семь" in "восемь"); one that ends in a digit also ends the number ("8" is not "180"). A fact's entries name
the answer and what it is about ("eight|8" and "spider"), so a reply that states another fact with the same
number ("There are eight bits in one byte.") is not taken for it. Every single-turn
held-out dialog needs an entry, so a new held-out question cannot go unchecked. The share of held-out replies
that pass is counted over every reply to a prompt of the file (the first reply, after a system prompt, and
the 2nd and 3rd turn of the held-out conversations), by language (Cyrillic letters: Russian) and turn kind.
"""

from __future__ import annotations

import json
import re

from clgpt.errors import ClgptError

LANGUAGES = ("en", "ru")
KINDS = ("first", "system", "later")  # as clgpt.eval.evaluate.TURN_KINDS


def language(text: str) -> str:
    return "ru" if any("а" <= c <= "я" or c == "ё" for c in text.lower()) else "en"


def load_accept(path: str, heldout_dialogs: list[dict]) -> dict:
    """The checked rules {"acts": {name: [phrase]}, "prompts": {prompt: {"act": name} | {"has": [alternatives]}}};
    errors name the file and the key, and a single-turn held-out prompt without a rule."""
    try:
        with open(path, encoding="utf-8") as f:
            rules = json.load(f)
    except (OSError, ValueError) as e:
        raise ClgptError(f"{path}: cannot read the acceptable replies ({e}); "
                         "fix the file or set corpus.tune_accept: null") from None
    acts, prompts = (rules.get("acts"), rules.get("prompts")) if isinstance(rules, dict) else (None, None)
    if not isinstance(acts, dict) or not isinstance(prompts, dict):
        raise ClgptError(f'{path}: expected {{"acts": {{...}}, "prompts": {{...}}}}; see clgpt/eval/accept.py')
    for name, phrases in acts.items():
        if not isinstance(phrases, list) or not phrases or not all(isinstance(p, str) and p.strip() for p in phrases):
            raise ClgptError(f"{path}: acts.{name}: give a list of phrases")
    for prompt, rule in prompts.items():
        if not isinstance(rule, dict) or len(rule) != 1 or not ({"act", "has"} & set(rule)):
            raise ClgptError(f'{path}: prompts[{prompt!r}]: give {{"act": NAME}} or {{"has": ["word|other", ...]}}')
        if "act" in rule and rule["act"] not in acts:
            raise ClgptError(f"{path}: prompts[{prompt!r}]: act {rule['act']!r} is not one of acts ({', '.join(acts)})")
        has = rule.get("has", ["x"])
        if not isinstance(has, list) or not has or not all(isinstance(h, str) and h.strip("|") for h in has):
            raise ClgptError(f"{path}: prompts[{prompt!r}].has: give a list of words (alternatives split by |)")
    for d in heldout_dialogs:
        roles = [m["role"] for m in d["messages"]]
        if roles == ["user", "assistant"] and d["messages"][0]["content"] not in prompts:
            raise ClgptError(f"{path}: no acceptable reply for the held-out prompt {d['messages'][0]['content']!r} "
                             f"({d.get('source', 'held-out dialogs')}); add it under prompts")
    return {"acts": acts, "prompts": prompts}


def holds(text: str, phrase: str) -> bool:
    """Whether lower-case `text` holds `phrase` from a word's start (and, where it ends in a digit, to the
    number's end)."""
    end = r"(?!\d)" if phrase[-1:].isdigit() else ""
    return re.search(r"(?<!\w)" + re.escape(phrase.lower()) + end, text) is not None


def acceptable(reply: str, rule: dict, acts: dict) -> bool:
    text = reply.lower()
    if "act" in rule:
        return any(holds(text, p) for p in acts[rule["act"]])
    return all(any(holds(text, alt) for alt in entry.split("|") if alt) for entry in rule["has"])


def _rate(ok: int, total: int) -> dict:
    return {"matches": ok, "total": total, "rate": ok / total if total else 0.0}


def accept_scores(answers: list[dict], rules: dict) -> dict:
    """Over the held-out answers (clgpt.eval.evaluate's: user, kind, answer, match) to prompts with a rule:
    {"all": rate, "by_language": {lang: {"all": rate, kind: rate}}, "exact": the same replies word for word,
    "prompts": {prompt: {"acceptable", "exact", "total"}}}; marks each such answer with "acceptable"."""
    picked = [a for a in answers if a["user"] in rules["prompts"]]
    for a in picked:
        a["acceptable"] = acceptable(a["answer"], rules["prompts"][a["user"]], rules["acts"])
    by_language = {}
    for lang in LANGUAGES:
        mine = [a for a in picked if language(a["user"]) == lang]
        by_language[lang] = {"all": _rate(sum(a["acceptable"] for a in mine), len(mine)),
                             "exact": _rate(sum(a["match"] for a in mine), len(mine)),
                             **{k: _rate(sum(a["acceptable"] for a in mine if a["kind"] == k),
                                         sum(a["kind"] == k for a in mine)) for k in KINDS}}
    prompts = {}
    for a in picked:
        p = prompts.setdefault(a["user"], {"acceptable": 0, "exact": 0, "total": 0})
        p["acceptable"] += a["acceptable"]
        p["exact"] += a["match"]
        p["total"] += 1
    return {"all": _rate(sum(a["acceptable"] for a in picked), len(picked)),
            "exact": _rate(sum(a["match"] for a in picked), len(picked)), "by_language": by_language,
            "prompts": prompts}


def accept_markdown(r: dict | None) -> list[str]:
    """The report's section on acceptable held-out replies (none without rules)."""
    if not r:
        return []
    rate = lambda x: f"{x['matches']}/{x['total']} ({100 * x['rate']:.1f}%)"  # noqa: E731
    lines = ["## Held-out prompts: does the reply carry the expected fact or act?", "",
             f"Acceptable: {rate(r['all'])} of the replies to held-out prompts (word for word: {rate(r['exact'])}). "
             "A reply is acceptable when it holds the fact's words (the answer and what it is about, each from a "
             "word's start) or answers the act in kind (a greeting by a greeting), as the acceptable-replies file "
             "defines them; each prompt is asked as the first turn, after a system prompt, and as the 2nd or 3rd "
             "turn.", "",
             "| language | acceptable | first reply | after a system prompt | 2nd and later | word for word |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for lang, s in r["by_language"].items():
        lines.append(f"| {lang} | {rate(s['all'])} | {rate(s['first'])} | {rate(s['system'])} | {rate(s['later'])} | "
                     f"{rate(s['exact'])} |")
    lines += ["", "| prompt | acceptable | word for word |", "| --- | ---: | ---: |"]
    lines += [f"| {prompt.replace('|', chr(92) + '|')} | {p['acceptable']}/{p['total']} | {p['exact']}/{p['total']} |"
              for prompt, p in r["prompts"].items()]
    return lines + [""]
