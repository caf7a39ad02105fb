"""Writes the generated part of the tune data (`tune/chat.jsonl`) and the conversations of `heldout/tune.jsonl`
from the single-turn dialogs (`tune/en.jsonl`, `ru.jsonl`, `talk.jsonl`, `facts.jsonl`), the system prompts of
`system/pool.txt` (training) and `heldout/system.txt` (evaluation only). Deterministic (seeded); run it again
after editing the dialogs or the prompts:

    python data/compose_chats.py

`tune/chat.jsonl` holds, for each tune question: paraphrases of it made by the rules below (as a user would ask
it: other words, a lead-in such as "Tell me,", lower case without the question mark), each a conversation of its
own; and the question and one paraphrase after a system prompt and as the 2nd and 3rd turn after other
questions. Every reply is the reply of its single-turn dialog, so a model can answer each turn word for word
whatever came before it. The system prompts are drawn with their own random stream: editing the pool changes the
system prompts and nothing else.

The held-out file keeps its single-turn dialogs (`heldout/tune.jsonl` up to its first conversation: the first 16,
then the everyday openers and paraphrases added after them) and gains conversations built on them; no held-out
question is a tune question or a paraphrase the rules make of one (they are left out of the tune data).
"""

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
# share of the two- and three-turn conversations that open with a system prompt (the rest have none)
P_SYSTEM = {"tune": 3 / 4, "heldout": 1 / 3}
N_PARAPHRASES = 2  # of each tune question: one asked in the composed conversations, one a conversation of its own
# the held-out dialogs composed into conversations as they were before the openers were added (their first 16)
N_HELDOUT_FIRST = 16

# ---- paraphrase rules: (pattern on the question, replacement); English, then Russian --------------------
REWRITES = {
    "en": [
        (r"^What is the capital of (.+)\?$", r"Name the capital of \1."),
        (r"^What is the capital of (.+)\?$", r"Which city is the capital of \1?"),
        (r"^What is the (\w+est) (.+)\?$", r"Which \2 is the \1?"),
        (r"^How many (.+) (?:does|do) (.+) have\?$", r"How many \1 has \2 got?"),
        (r"^How many (.+) are in (an?|one) (.+)\?$", r"How many \1 does \2 \3 have?"),
        (r"^What does (.+) do\?$", r"What is the job of \1?"),
        (r"^Who (wrote|created) (.+)\?$", r"Who is the one who \1 \2?"),
    ],
    "ru": [
        (r"^Какая столица (.+)\?$", r"Назови столицу \1."),
        (r"^Какая столица (.+)\?$", r"Какой город — столица \1?"),
        (r"^Сколько (\S+) в (.+)\?$", r"Сколько в \2 \1?"),
        (r"^Сколько (\S+) у (.+)\?$", r"Сколько у \2 \1?"),
        (r"^(Какая|Какое|Какой) (\S+) (самая|самое|самый) (\S+)\?$", r"\1 \3 \4 \2?"),
        (r"^Что делает (.+)\?$", r"Для чего нужен \1?"),
    ],
}
SYNONYMS = {"en": [("largest", "biggest"), ("highest", "tallest"), ("fastest", "quickest")],
            "ru": [("самая большая", "крупнейшая"), ("самое большое", "самое крупное")]}
# lead-ins a question takes as it is; {q} is the question with a lower-case first letter
LEAD_INS = {
    "en": ["Tell me, {q}", "Quick question: {q}", "Hey, {q}", "I wonder, {q}", "Can you tell me, {q}",
           "Hi! {Q}", "Please answer: {Q}", "Do you know this? {Q}"],
    "ru": ["Скажи, {q}", "Подскажи, {q}", "Слушай, {q}", "Вопрос: {Q}", "Привет! {Q}", "Ты знаешь? {Q}",
           "А {q}"],
}

GREETING_LEAD_INS = {"en": ["Oh, {q}", "Well, {q}", "Hey, {q}"], "ru": ["Ну, {q}", "Эй, {q}", "Так, {q}"]}


def lower_first(text: str) -> str:
    return text if text.startswith(("I ", "clgpt")) else text[:1].lower() + text[1:]


def casual(text: str) -> str:
    """As typed in a hurry: lower case, no closing punctuation."""
    return text.lower().rstrip("?!.")


def paraphrases(question: str, lang: str) -> list[str]:
    """Every paraphrase the rules make of a question: rewrites and synonyms first, then the lead-ins and the
    casual form."""
    out = [re.sub(p, r, question) for p, r in REWRITES[lang] if re.match(p, question)]
    out += [question.replace(a, b) for a, b in SYNONYMS[lang] if a in question]
    if question.endswith("?"):
        out += [lead.format(q=lower_first(question), Q=question) for lead in LEAD_INS[lang]]
    else:  # small talk and requests: the same words with other punctuation, or after a greeting
        out += [question.rstrip("!.") + end for end in ("", ".", "!", "!!")]
        out += [lead.format(q=lower_first(question)) for lead in GREETING_LEAD_INS[lang]]
    out.append(casual(question))
    return list(dict.fromkeys(p for p in out if p != question))


def key(text: str) -> str:
    """What two prompts share when they ask the same words: case and punctuation aside."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def read_prompts(path: Path) -> list[str]:
    """System prompts, one a line."""
    return path.read_text(encoding="utf-8").splitlines()


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """The single-turn {"user", "assistant"} lines of a file (its "messages" lines are left out)."""
    return [(d["user"], d["assistant"]) for d in read_lines(path) if "user" in d]


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
            others: dict | None = None, reword=None) -> list[dict]:
    """For each pair of each language: `repeats` single turns after a system prompt, and `repeats`
    conversations with it as the 2nd and as the 3rd turn after other pairs (from `others` when given);
    a share p_system of the conversations open with a system prompt. system() gives the next prompt;
    reword(pair, r) gives the pair to ask in repeat r (the pair itself when not given)."""
    out = []
    for lang, pairs in by_lang.items():
        pool = (others or by_lang)[lang]
        for pair in pairs:
            for r in range(repeats):
                asked = reword(pair, r) if reword else pair
                out.append(conversation([asked], system()))
                for n_before in (1, 2):
                    before = rng.sample([p for p in pool if p != pair], n_before)
                    out.append(conversation([*before, asked], system() if rng.random() < p_system else None))
    rng.shuffle(out)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    pool, heldout_systems = read_prompts(HERE / "system/pool.txt"), read_prompts(HERE / "heldout/system.txt")
    if set(pool) & set(heldout_systems):
        raise SystemExit(f"error: heldout/system.txt repeats a prompt of system/pool.txt: {sorted(set(pool) & set(heldout_systems))[0]!r}")
    base = by_language(read_pairs(HERE / "tune/en.jsonl") + read_pairs(HERE / "tune/ru.jsonl"))
    tune = by_language([p for f in ("en", "ru", "talk", "facts") for p in read_pairs(HERE / f"tune/{f}.jsonl")])
    singles = [d for d in read_lines(HERE / "heldout/tune.jsonl") if "user" in d]
    heldout_keys = {key(d["user"]) for d in singles}
    clash = [q for pairs in tune.values() for q, _ in pairs if key(q) in heldout_keys]
    if clash:
        raise SystemExit(f"error: the held-out dialogs ask a tune question: {clash[0]!r}; reword one of them")
    # a paraphrase that a held-out question happens to be is left out: that question stays unseen
    rng = random.Random(16)
    reworded = {}
    for lang, pairs in tune.items():
        for q, a in pairs:
            made = [p for p in paraphrases(q, lang) if key(p) not in heldout_keys]
            reworded[q] = [(p, a) for p in rng.sample(made, min(len(made), N_PARAPHRASES))]
    # any prompt with any language: clients put their (mostly English) default in front of every chat
    draw = random.Random(15)
    reword = lambda pair, r: pair if r == 0 or not reworded[pair[0]] else reworded[pair[0]][0]  # noqa: E731
    # the small talk and the corpus facts once (as themselves), the first dialogs also once reworded
    chats = compose(base, lambda: draw.choice(pool), random.Random(13), repeats=2, p_system=P_SYSTEM["tune"],
                    others=tune, reword=reword)
    chats += compose(by_language([p for f in ("talk", "facts") for p in read_pairs(HERE / f"tune/{f}.jsonl")]),
                     lambda: draw.choice(pool), random.Random(19), repeats=1, p_system=P_SYSTEM["tune"], others=tune)
    random.Random(13).shuffle(chats)
    # the paraphrases no conversation above asks (the small talk's and the facts' all of them), each on its own
    asked = {q for pairs in base.values() for q, _ in pairs}
    alone = [conversation([p], None) for pairs in tune.values() for q, _ in pairs
             for p in reworded[q][1 if q in asked else 0 :]]
    random.Random(17).shuffle(alone)
    write_jsonl(HERE / "tune/chat.jsonl", chats + alone)
    # the held-out file keeps its single-turn lines first, then gains the conversations built on them (the
    # first 16 as before the openers came, then the openers'); the held-out prompts come in turn, so each one
    # is there (the evaluation asks the tune questions after them)
    turn = iter(heldout_systems * 100)
    first, added = by_language([(d["user"], d["assistant"]) for d in singles[:N_HELDOUT_FIRST]]), \
        by_language([(d["user"], d["assistant"]) for d in singles[N_HELDOUT_FIRST:]])
    chats = compose(first, lambda: next(turn), random.Random(14), repeats=1, p_system=P_SYSTEM["heldout"], others=base)
    chats += compose(added, lambda: next(turn), random.Random(18), repeats=1, p_system=P_SYSTEM["heldout"], others=base)
    write_jsonl(HERE / "heldout/tune.jsonl", singles + chats)


if __name__ == "__main__":
    main()
