"""Writes the chat part of the corpus (`tune/chat.jsonl`, and the conversations at the end of `heldout/tune.jsonl`) from the single-turn dialogs
and the system prompts below: conversations of two and three user turns, and single questions after a
system prompt. Deterministic (seeded); run it again after editing the dialogs or the prompts:

    python data/compose_chats.py

Every reply is a reply of the single-turn dialogs, so a model that answers those word for word can answer
each turn of these conversations word for word too, whatever came before it.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

# System prompts the tune set uses (English for English dialogs, Russian for Russian ones).
SYSTEM = {
    "en": [
        "You are a helpful assistant.",
        "You are clgpt, a small and friendly language model.",
        "Answer the question in one short sentence.",
        "You are a friendly assistant. Keep your answers short.",
        "You are a helpful assistant that answers questions about science and the world.",
    ],
    "ru": [
        "Ты полезный помощник.",
        "Ты clgpt, маленькая и дружелюбная языковая модель.",
        "Отвечай коротко, одним предложением.",
        "You are a helpful assistant.",
    ],
}
# Held-out system prompts: never trained on.
SYSTEM_HELDOUT = {
    "en": ["You are a knowledgeable assistant.", "Be brief and accurate."],
    "ru": ["Ты дружелюбный помощник.", "Be brief and accurate."],
}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """The single-turn {"user", "assistant"} lines of a file (its "messages" lines are left out)."""
    return [(d["user"], d["assistant"]) for d in read_lines(path) if "user" in d]


def conversation(pairs: list[tuple[str, str]], system: str | None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def compose(by_lang: dict, system: dict, rng: random.Random, repeats: int, others: dict | None = None) -> list[dict]:
    """For each pair of each language: `repeats` single turns after a system prompt, and `repeats`
    conversations with it as the 2nd and as the 3rd turn after other pairs (from `others` when given);
    a third of the conversations open with a system prompt."""
    out = []
    for lang, pairs in by_lang.items():
        pool = (others or by_lang)[lang]
        for pair in pairs:
            for r in range(repeats):
                out.append(conversation([pair], system[lang][rng.randrange(len(system[lang]))]))
                for n_before in (1, 2):
                    before = rng.sample([p for p in pool if p != pair], n_before)
                    sys_prompt = system[lang][rng.randrange(len(system[lang]))] if rng.random() < 1 / 3 else None
                    out.append(conversation([*before, pair], sys_prompt))
    rng.shuffle(out)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    tune = {"en": read_pairs(HERE / "tune/en.jsonl"), "ru": read_pairs(HERE / "tune/ru.jsonl")}
    heldout = {"en": [], "ru": []}
    for user, assistant in read_pairs(HERE / "heldout/tune.jsonl"):
        heldout["ru" if any("а" <= c <= "я" for c in user.lower()) else "en"].append((user, assistant))
    write_jsonl(HERE / "tune/chat.jsonl", compose(tune, SYSTEM, random.Random(13), repeats=2))
    # the held-out file keeps its single-turn lines first, then gains the conversations built on them
    singles = [d for d in read_lines(HERE / "heldout/tune.jsonl") if "user" in d]
    chats = compose(heldout, SYSTEM_HELDOUT, random.Random(14), repeats=1, others=tune)
    write_jsonl(HERE / "heldout/tune.jsonl", singles + chats)


if __name__ == "__main__":
    main()
