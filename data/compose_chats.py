"""Writes the chat part of the corpus (`tune/chat.jsonl`, and the conversations at the end of `heldout/tune.jsonl`) from the single-turn dialogs
and the system prompts of `system/pool.txt` (training) and `heldout/system.txt` (evaluation only): conversations of two and three user
turns, and single questions after a system prompt. Deterministic (seeded); run it again after editing the dialogs or the prompts:

    python data/compose_chats.py

Every reply is a reply of the single-turn dialogs, so a model that answers those word for word can answer
each turn of these conversations word for word too, whatever came before it. The system prompts are drawn
with their own random stream: editing the pool changes the system prompts and nothing else.

The held-out file's single-turn dialogs come first (the first N_HELDOUT_FIRST, then the everyday openers and
paraphrases added after them); no held-out question may be a tune question (case and punctuation aside).
"""

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
# share of the two- and three-turn conversations that open with a system prompt (the rest have none)
P_SYSTEM = {"tune": 3 / 4, "heldout": 1 / 3}
# the held-out dialogs composed into conversations as they were before the everyday openers were added
N_HELDOUT_FIRST = 16


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def read_prompts(path: Path) -> list[str]:
    """System prompts, one a line."""
    return path.read_text(encoding="utf-8").splitlines()


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """The single-turn {"user", "assistant"} lines of a file (its "messages" lines are left out)."""
    return [(d["user"], d["assistant"]) for d in read_lines(path) if "user" in d]


def key(text: str) -> str:
    """What two prompts share when they ask the same words: case and punctuation aside."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def language(text: str) -> str:
    return "ru" if any("а" <= c <= "я" or c == "ё" for c in text.lower()) else "en"


def by_language(pairs: list[tuple[str, str]]) -> dict:
    out = {"en": [], "ru": []}
    for pair in pairs:
        out[language(pair[0])].append(pair)
    return out


def conversation(pairs: list[tuple[str, str]], system: str | None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def compose(by_lang: dict, system, rng: random.Random, repeats: int, p_system: float,
            others: dict | None = None) -> list[dict]:
    """For each pair of each language: `repeats` single turns after a system prompt, and `repeats`
    conversations with it as the 2nd and as the 3rd turn after other pairs (from `others` when given);
    a share p_system of the conversations open with a system prompt. system() gives the next prompt."""
    out = []
    for lang, pairs in by_lang.items():
        pool = (others or by_lang)[lang]
        for pair in pairs:
            for r in range(repeats):
                out.append(conversation([pair], system()))
                for n_before in (1, 2):
                    before = rng.sample([p for p in pool if p != pair], n_before)
                    out.append(conversation([*before, pair], system() if rng.random() < p_system else None))
    rng.shuffle(out)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    pool, heldout_systems = read_prompts(HERE / "system/pool.txt"), read_prompts(HERE / "heldout/system.txt")
    if set(pool) & set(heldout_systems):
        raise SystemExit(f"error: heldout/system.txt repeats a prompt of system/pool.txt: {sorted(set(pool) & set(heldout_systems))[0]!r}")
    tune = {"en": read_pairs(HERE / "tune/en.jsonl"), "ru": read_pairs(HERE / "tune/ru.jsonl")}
    singles = [d for d in read_lines(HERE / "heldout/tune.jsonl") if "user" in d]
    heldout_keys = {key(d["user"]) for d in singles}
    clash = [q for pairs in tune.values() for q, _ in pairs if key(q) in heldout_keys]
    if clash:
        raise SystemExit(f"error: the held-out dialogs ask a tune question: {clash[0]!r}; reword one of them")
    # any prompt with any language: clients put their (mostly English) default in front of every chat
    draw = random.Random(15)
    write_jsonl(HERE / "tune/chat.jsonl", compose(tune, lambda: draw.choice(pool), random.Random(13), repeats=2,
                                                  p_system=P_SYSTEM["tune"]))
    # the held-out file keeps its single-turn lines first, then gains the conversations built on them: those of
    # the first N_HELDOUT_FIRST as they were before the everyday openers came (so their replies stay comparable),
    # then the openers'; the held-out prompts come in turn, so each one is there (the evaluation asks the tune
    # questions after them)
    turn = iter(heldout_systems * 100)
    first = by_language([(d["user"], d["assistant"]) for d in singles[:N_HELDOUT_FIRST]])
    added = by_language([(d["user"], d["assistant"]) for d in singles[N_HELDOUT_FIRST:]])
    chats = compose(first, lambda: next(turn), random.Random(14), repeats=1, p_system=P_SYSTEM["heldout"],
                    others=tune)
    chats += compose(added, lambda: next(turn), random.Random(18), repeats=1, p_system=P_SYSTEM["heldout"],
                     others=tune)
    write_jsonl(HERE / "heldout/tune.jsonl", singles + chats)

if __name__ == "__main__":
    main()
