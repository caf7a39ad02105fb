"""Writes the generated part of the tune data (`tune/chat.jsonl`) and the conversations of `heldout/tune.jsonl`
from the single-turn dialogs (`tune/en.jsonl`, `ru.jsonl`, `talk.jsonl`, `facts.jsonl`), the corpus lines of
`pretrain/`, the system prompts of `system/pool.txt` (training) and `heldout/system.txt` (evaluation only).
Deterministic (seeded); run it again after editing the dialogs, the corpus or the prompts:

    python data/compose_chats.py

`tune/chat.jsonl` holds, for each tune question: paraphrases of it made by the rules below (as a user would ask
it: other words, a lead-in such as "Tell me,", lower case without the question mark); and the question and one
paraphrase after a system prompt and as the 2nd and 3rd turn after other questions. Every reply is the reply of
its single-turn dialog, so a model can answer each turn word for word whatever came before it. The system prompts
are drawn with their own random stream: editing the pool changes the system prompts and nothing else.

It also asks about every corpus line: rules read a subject and a relation off the line ("Madrid is the capital of
Spain." -> "Which city is the capital of Spain?", "Tell me about Madrid.") and answer in the tune dialogs' style
(the capital as "The capital of Spain is Madrid.", a count by its clause, else the line; a hand-written reply
that states the same fact is taken as it is, so a fact has one reply whatever the wording). These questions, a
paraphrase of each, the fact questions and the spare paraphrases are asked three to a conversation.

The held-out file keeps its single-turn dialogs (`heldout/tune.jsonl` up to its first conversation: the first 16,
then the everyday openers and paraphrases added after them) and gains conversations built on them. No held-out
question is asked in the tune data, case and punctuation aside: a paraphrase or a question on a corpus line that
happens to be one is left out, and a hand-written dialog that asks one stops the script. The held-out facts are
asked in the tune data in other words, so the held-out split measures new wordings of known facts.
"""

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
# share of the two- and three-turn conversations that open with a system prompt (the rest have none)
P_SYSTEM = {"tune": 3 / 4, "packed": 1 / 2, "heldout": 1 / 3}
N_PARAPHRASES = 2  # of each tune question: one asked in the composed conversations, one a conversation of its own
# the held-out dialogs composed into conversations as they were before the openers were added (their first 16)
N_HELDOUT_FIRST = 16
PACKED = 3  # questions a conversation of the packed part asks
# paraphrases of each question made of a corpus line, asked beside it: two, with half the packed conversations after
# a system prompt, carry more held-out wordings (bench/RESULTS.md, "Tune recipes measured on the held-out openers")
N_MADE_PARAPHRASES = 2

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


# ---- questions on every corpus line, made by rules from the line itself ----------------------------
# Each rule reads a subject and a relation off a line of pretrain/*.txt and asks about it in several forms; the
# reply is in the tune dialogs' style: "The capital of X is Y." for a capital, the clause that answers a count,
# the line itself otherwise. Most lines also get the general questions ("Tell me about X.").
NUMBER = (r"(?:\d+|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty four|thirty|sixty|"
          r"one hundred|hundred)")
# the verbs a line's subject does, in the corpus's words (for "What does X do?" and to find the subject)
EN_DOES = ("travels", "turns", "shines", "freezes", "boils", "rusts", "forms", "attract", "pulls",
           "floats", "make", "begin", "begins", "store", "pumps", "controls", "take", "carry", "breaks", "helps",
           "follows", "runs",
           "connects", "predicts", "learns", "stores", "holds", "keeps", "hunt", "breathe", "means")
EN_SPLIT = re.compile(r" (?:is|are|was|were|has|have|can|cannot|takes|contains|began|ended|reached|built|wrote|"
                      r"created|described|won|often|usually|always|probably|plus|times|equals|"
                      + "|".join(EN_DOES) + ") ")
NAME = re.compile(r"(?!The )[A-Z]\w+ [A-Z]\w+")  # a person's first and last name
EN_PAST = dict(wrote="write", created="create", built="build", described="describe", reached="reach", won="win",
               made="make")


def in_sentence(word: str, known: set[str]) -> str:
    """A line's first word as it stands inside a sentence: lower case where the corpus writes it (or, from its
    sixth letter on, a form of it) in lower case: a common noun, an article; as it is otherwise: a name."""
    low = word.lower()
    stem = low[:5] if len(low) > 5 else low
    if word in ("The", "A", "An") or low in known or len(low) > 5 and any(w.startswith(stem) for w in known):
        return low
    return word


def subject_phrase(subj: str, known: set[str]) -> str:
    words = subj.split()
    return " ".join([in_sentence(words[0], known), *words[1:]])


def en_line_questions(line: str, known: set[str]) -> list[tuple[str, str]]:
    """(question, reply) pairs the English rules make of one corpus line."""
    body = line.rstrip(".")
    out = []
    m = re.match(r"^(\w[\w ]*?) is the capital (?:and largest city )?of (.+?)(?:,| and |$)", body)
    if m:
        city, country = m.groups()
        reply = f"The capital of {country} is {city}."
        out += [(f"What is the capital of {country}?", reply), (f"Which city is the capital of {country}?", reply),
                (f"Tell me the capital of {country}.", reply), (f"What city is the capital of {country}?", reply),
                (f"Name the capital of {country}.", reply), (f"What is {country}'s capital?", reply)]
    m = re.match(r"^(.+?) (is|are) the (\w+est|only) (.+)$", body)
    if m and not out:
        subj, verb, adj, rest = m.groups()
        rest = re.split(r",| and is | because ", rest)[0]
        words = rest.split()
        noun = words[1] if words[0] in ("land", "hot") and len(words) > 1 else words[0]
        reply = f"{subj} {verb} the {adj} {rest}."
        out.append((f"What {verb} the {adj} {rest}?", reply))
        if adj != "only":
            out.append((f"Which {noun} {verb} the {adj} {rest}?".replace(f" the {adj} {noun} ", f" the {adj} ")
                        .replace(f"the {adj} {noun}?", f"the {adj}?"), reply))
            out += [(f"Name the {adj} {rest}.", reply), (f"What {verb} the {adj} {noun}?", reply)]
    m = re.match(rf"^(.+?) (has|have) ({NUMBER}) (.+)$", body)
    if m and "," not in m.group(1):
        subj, verb, num, rest = m.groups()
        for part in re.split(r", and | and ", f"{num} {rest}"):
            part = re.split(r",|:| instead| including| from ", part)[0].strip()
            if not re.match(NUMBER + " ", part):
                continue
            noun, s = part.split()[-1], subject_phrase(subj, known)
            reply = f"{subj} {verb} {part}."
            out += [(f"How many {noun} {'does' if verb == 'has' else 'do'} {s} have?", reply),
                    (f"How many {noun} {verb} {s} got?", reply), (f"Tell me how many {noun} {s} {verb}.", reply)]
    m = re.match(rf"^There are ({NUMBER}) (\w+) in (.+)$", body)
    if m:
        num, noun, where = m.groups()
        out += [(f"How many {noun} are there in {where}?", line), (f"How many {noun} does {where} have?", line)]
    m = re.match(r"^([A-Z]\w+ [A-Z]\w+) (was|were) the first (.+?)(?:, in \d+| in \d+)?$", body)
    if m:
        subj, verb, what = m.groups()
        out += [(f"Who was the first {what}?", line), (f"Name the first {what}.", line),
                (f"Do you know who was the first {what}?", line)]
    m = re.match(r"^((?:[A-Z]\w+ )+?|The ancient \w+ |The Wright brothers )"
                 r"(wrote|created|built|described|reached|won|made) "
                 r"(.+?)(?: around \d+| in \d+|, in \d+)?$", body)
    if m:
        subj, verb, what = m.groups()
        what = what[:1].lower() + what[1:] if what.split()[0] in ("The", "A") else what
        out += [(f"Who {verb} {what}?", line), (f"Do you know who {verb} {what}?", line),
                (f"Tell me who {verb} {what}.", line)]
        if re.search(r"\b1\d\d\d\b", line):
            out.append((f"When did {subject_phrase(subj.strip(), known)} {EN_PAST[verb]} {what}?", line))
    m = re.match(r"^(.+?) (began|ended) in (\d+)$", body)
    if m:
        subj, verb, _ = m.groups()
        base, s = {"began": "begin", "ended": "end"}[verb], subject_phrase(subj, known)
        out += [(f"When did {s} {base}?", line), (f"In what year did {s} {base}?", line)]
    m = re.match(r"^(.+?) (is|are) (an?|made of|mostly|both|famous for|the part|neither|called) (.+)$", body)
    if m and len(m.group(1).split()) <= 4:
        subj, verb, kind, rest = m.groups()
        s = subject_phrase(subj, known)
        question = {"made of": f"What {verb} {s} made of?", "famous for": f"What {verb} {s} famous for?",
                    "mostly": f"What {verb} {s} mostly?", "called": f"What {verb} {s} called?"}.get(
            kind, f"{'Who' if NAME.fullmatch(subj) else 'What'} {verb} {s}?")
        out.append((question, line))
    m = re.match(r"^(\w+) (plus|times) (\w+) equals ([^,]+)", body)
    if m:
        a, op, b, _ = m.groups()
        reply = body.split(",")[0] + "."
        out += [(f"What is {a.lower()} {op} {b}?", reply), (f"How much is {a.lower()} {op} {b}?", reply)]
    m = re.match(r"^((?:Half|The \w+(?: \w+)?) of [^,]+?) (is|are|always add up to) ([^,]+)", body)
    if m:
        subj, verb, _ = m.groups()
        s = subject_phrase(subj, known)
        reply = body.split(",")[0] + "."
        out.append((f"What do {s} add up to?" if verb.startswith("always") else f"What {verb} {s}?", reply))
    m = re.match(r"^(.+?) helps (.+)$", body)
    if m:
        out.append((f"What helps {m.group(2)}?", line))
    m = re.match(r"^Every (.+?) is (.+)$", body)
    if m:
        out.append((f"What is true of every {m.group(1)}?", line))
    m = re.match(r"^Most of (.+?) is (in|covered by) (.+)$", body)
    if m:
        what, rel, _ = m.groups()
        out.append((f"Where is most of {what}?" if rel == "in" else f"What covers most of {what}?", line))
    m = re.match(r"^(.+?) (is|are) (.+?) because (.+)$", body) or re.match(r"^(.+?) (\w+s) because (.+)$", body)
    if m and len(m.group(1).split()) <= 3:
        s = subject_phrase(m.group(1), known)
        if m.group(2) in ("is", "are"):
            out.append((f"Why {m.group(2)} {s} {m.group(3)}?", line))
        else:
            out.append((f"Why does {s} {m.group(2)[:-1]}?", line))
    parts = EN_SPLIT.split(re.sub(r"^Most (of )?", "", body), maxsplit=1)
    subj = parts[0]
    if len(parts) == 2 and len(subj.split()) <= 4 and " we" not in subj and not subj.startswith(
            ("There", "Most", "Half", "Two", "Ten")):
        s = subject_phrase(subj, known)
        verb = body[len(subj) + 1:].split()[0]
        if verb in EN_DOES:
            out.append((f"What {'does' if verb.endswith('s') else 'do'} {s} do?", line))
        out += [(f"Tell me about {s}.", line), (f"What do you know about {s}?", line),
                (f"Tell me something about {s}.", line)]
    return out


RU_GENDER = {"самая": "Какая", "самое": "Какое", "самый": "Какой"}
RU_NUMBERS = ("пять", "шесть", "семь", "восемь", "двенадцать", "шестьдесят", "206")  # their noun: genitive plural
RU_FEW = ("два", "две", "три", "четыре")  # their noun: genitive singular ("три угла"); a question asks the plural
RU_ADJ = re.compile(r"(ая|ое|ый|ий|ой|ие|ые|ее|ую|ых|их)$")
RU_VERB = re.compile(r"(ет|ит|ют|ят|ат|ут|ется|ится)$")
RU_PLURAL_VERB = re.compile(r"(ют|ят|ат|ут)$")
RU_PREPOSITIONS = ("в", "на", "у", "по", "из")
RU_IMPERSONAL = ("называют", "считают", "пекут")  # "they call Mars ...": Mars does not do it


def ru_accusative(phrase: str) -> str:
    """A feminine phrase in the accusative ("самая большая страна в мире" -> "самую большую страну в мире"): its
    adjectives and the noun after them; other genders read the same (inanimate)."""
    words = phrase.split()
    out = []
    for i, w in enumerate(words):
        if out and not RU_ADJ.search(out[-1]) or w in RU_PREPOSITIONS:
            return " ".join(out + words[i:])
        w = re.sub(r"ая$", "ую", w)
        w = re.sub(r"яя$", "юю", w)
        w = re.sub(r"([^ая])а$", r"\1у", w) if not RU_ADJ.search(w) else w
        w = re.sub(r"([^и])я$", r"\1ю", w) if not RU_ADJ.search(w) else w
        out.append(w)
    return " ".join(out)


def ru_line_questions(line: str, known: set[str]) -> list[tuple[str, str]]:
    """The Russian rules, as en_line_questions."""
    body = line.rstrip(".")
    out = []
    m = re.match(r"^(\S+) — столица (?:и самый большой город )?([^\s,]+)", body)
    if m:
        city, country = m.groups()
        reply = f"Столица {country} — это {city}."
        out += [(f"Какая столица {country}?", reply), (f"Какой город — столица {country}?", reply),
                (f"Назови столицу {country}.", reply), (f"Столица {country} — какой город?", reply),
                (f"Скажи, какой город является столицей {country}?", reply)]
    m = re.match(r"^(.+?) — (самая|самое|самый) ([^,]+)", body)
    if m and not out:
        subj, most, rest = m.groups()
        reply = f"{most.capitalize()} {rest} — {subject_phrase(subj, known)}."
        which, words = RU_GENDER[most], rest.split()
        out += [(f"{which} {most} {rest}?", reply), (f"Назови {ru_accusative(f'{most} {rest}')}.", reply)]
        if len(words) >= 2 and not RU_ADJ.search(words[1]) and (len(words) == 2 or words[2] in RU_PREPOSITIONS):
            out.append((f"{which} {words[1]} {most} {words[0]}{''.join(' ' + w for w in words[2:])}?", reply))
    words = body.split()
    if words[0] in ("У", "В"):
        at = next((i for i, w in enumerate(words) if w.strip(",") in RU_NUMBERS + RU_FEW), None)
        if at and words[at - 1] == "двадцать":  # "двадцать четыре часа"
            at -= 1
        if at:
            phrase = []
            for w in words[at + 1:]:
                phrase.append(w.rstrip(",:"))
                if w != phrase[-1] or not RU_ADJ.search(w):
                    break
            num = " ".join(words[at: at + 2]) if words[at] == "двадцать" else words[at]
            phrase = phrase if words[at] != "двадцать" else [w.rstrip(",") for w in words[at + 2: at + 3]]
            where, noun, prep = " ".join(words[1:at]), phrase[-1], words[0].lower()
            if num.split()[-1] in RU_FEW:  # "стороны" -> "сторон", "угла" -> "углов"
                noun = re.sub(r"ы$", "", noun) if noun.endswith("ы") else re.sub(r"([^аеиоуыэюя])а$", r"\1ов", noun)
            reply = f"{words[0]} {where} {num} {' '.join(phrase)}."
            out += [(f"Сколько {noun} {prep} {where}?", reply), (f"Сколько {prep} {where} {noun}?", reply),
                    (f"Скажи, сколько {noun} {prep} {where}?", reply)]
    m = re.match(r"^(.+?) (первым полетел|первым ступил|написал|создал|основал|построили) "
                 r"(.+?)(?: в \d+ году| более .+)?$", body)
    if m:
        subj, verb, what = m.groups()
        v = verb[:-1] if verb.endswith("ли") else verb
        out += [(f"Кто {v} {what}?", line), (f"Скажи, кто {v} {what}?", line), (f"Ты знаешь, кто {v} {what}?", line)]
    m = re.match(r"^(.+?) (закончилась|началась) в (\d+) году$", body)
    if m:
        subj, verb, _ = m.groups()
        out += [(f"Когда {verb} {subj}?", line), (f"В каком году {verb} {subj}?", line)]
    m = re.match(r"^(.+?) (?:примерно )?(равно|равна|равен) (.+?)(?: и .+)?$", body)
    if m:
        subj, verb, _ = m.groups()
        s = subject_phrase(subj, known)
        out += [(f"Чему {verb} {s}?", body.split(" и ")[0] + "." if " и " in body else line),
                (f"Скажи, чему {verb} {s}?", body.split(" и ")[0] + "." if " и " in body else line)]
    m = re.match(r"^Если (.+?), получится (.+)$", body)
    if m:
        out += [(f"Что получится, если {m.group(1)}?", line), (f"Сколько будет, если {m.group(1)}?", line)]
    m = re.match(r"^(\S+) .+?, поэтому (?:он|она|оно|они) (\S+)$", body)
    if m:
        out.append((f"Почему {subject_phrase(m.group(1), known)} {m.group(2)}?", line))
    m = re.match(r"^(\S+) (нужны|нужен|нужна|нужно) (\S+), чтобы (.+)$", body)
    if m:
        subj, _, whom, _ = m.groups()
        s = subject_phrase(subj, known)
        out += [(f"Зачем {whom} {s}?", line), (f"Для чего {whom} {s}?", line)]
    m = re.match(r"^(.+?) полезно (.+)$", body)
    if m:
        out += [(f"Полезно ли {m.group(1)[0].lower() + m.group(1)[1:]}?", line)]
    dash = body.find(" — ")
    if 0 < dash and len(body[:dash].split()) <= 3:
        subj = subject_phrase(body[:dash], known)
        if body[dash:].startswith(" — это "):
            out.append((f"Что такое {subj}?", line))
    else:
        at = next((i for i, w in enumerate(words[:4]) if i and RU_VERB.search(w)), None)
        if not at or words[0] in ("У", "В", "Если", "Сумма", "Мыть", "Число", "Десять"):
            return out
        subj = subject_phrase(" ".join(w for w in words[:at] if w not in ("не", "первым", "зимой")).split(" в ")[0],
                              known)
        if not RU_VERB.search(words[at]).group(1).startswith(("ется", "ится")) and words[at] not in RU_IMPERSONAL:
            out.append((f"Что {'делают' if RU_PLURAL_VERB.search(words[at]) else 'делает'} {subj}?", line))
    out += [(f"Расскажи факт: {subj}.", line), (f"Что ты знаешь? Тема: {subj}.", line)]
    return out


def stems(text: str) -> set[str]:
    """The words that carry a statement (numbers, words of three letters or more), by their first five letters."""
    return {w[:5] for w in re.findall(r"\w+", text.lower()) if len(w) >= 3 or w.isdigit()}


def same_fact(reply: str, written: list[str]) -> str:
    """The reply of a hand-written dialog that states the same fact, so every question on a fact gets one reply;
    the rule's own reply where none does. Same fact: every word of the shorter of the two in the other, or 80%
    of them where it has six or more ("three sides" is not "three angles")."""
    mine, best, score = stems(reply), reply, 0.0
    for other in written:
        theirs = stems(other)
        shorter = min(len(mine), len(theirs))
        s = len(mine & theirs) / shorter
        if s > score and s >= (0.8 if shorter >= 6 else 1.0):
            best, score = other, s
    return best


def known_words(pretrain: Path) -> set[str]:
    """The words the corpus and the hand-written dialogs write in lower case."""
    text = " ".join((pretrain / f"{lang}.txt").read_text(encoding="utf-8") for lang in ("en", "ru")) + " ".join(
        (pretrain.parent / f"tune/{f}.jsonl").read_text(encoding="utf-8") for f in ("en", "ru", "talk", "facts"))
    return {w for w in re.findall(r"\w+", text) if w.islower()}


def corpus_questions(pretrain: Path, written: list[str] = ()) -> dict:
    """{"en": [(question, reply)], "ru": [...]}: every question the rules make of pretrain/en.txt and ru.txt,
    the first of each wording kept; a reply stating the fact of one of the written replies takes its words."""
    known = known_words(pretrain)
    out = {}
    for lang, rules in (("en", en_line_questions), ("ru", ru_line_questions)):
        seen, pairs = set(), []
        for line in (pretrain / f"{lang}.txt").read_text(encoding="utf-8").splitlines():
            for q, a in rules(line, known):
                if key(q) not in seen:
                    seen.add(key(q))
                    pairs.append((q, same_fact(a, written)))
        out[lang] = pairs
    return out


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


def sample(rng: random.Random, items: list, n: int) -> list:
    """n of items (all of them where there are fewer), drawn with rng."""
    return rng.sample(items, min(len(items), n))


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


def packed(by_lang: dict, system, rng: random.Random, p_system: float) -> list[dict]:
    """The pairs of each language shuffled and asked PACKED at a time, one conversation each; a share p_system
    of them open with a system prompt."""
    out = []
    for lang, pairs in by_lang.items():
        pairs = list(pairs)
        rng.shuffle(pairs)
        for i in range(0, len(pairs), PACKED):
            out.append(conversation(pairs[i: i + PACKED], system() if rng.random() < p_system else None))
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    pool, heldout_systems = read_prompts(HERE / "system/pool.txt"), read_prompts(HERE / "heldout/system.txt")
    if set(pool) & set(heldout_systems):
        raise SystemExit(f"error: heldout/system.txt repeats a prompt of system/pool.txt: {sorted(set(pool) & set(heldout_systems))[0]!r}")
    dialogs = {f: read_pairs(HERE / f"tune/{f}.jsonl") for f in ("en", "ru", "talk", "facts")}
    base = by_language(dialogs["en"] + dialogs["ru"])
    tune = by_language([p for pairs in dialogs.values() for p in pairs])
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
            reworded[q] = [(p, a) for p in sample(rng, made, N_PARAPHRASES)]
    # any prompt with any language: clients put their (mostly English) default in front of every chat
    draw = random.Random(15)
    reword = lambda pair, r: pair if r == 0 or not reworded[pair[0]] else reworded[pair[0]][0]  # noqa: E731
    # the first dialogs also once reworded; the small talk once, as itself
    chats = compose(base, lambda: draw.choice(pool), random.Random(13), repeats=2, p_system=P_SYSTEM["tune"],
                    others=tune, reword=reword)
    chats += compose(by_language(dialogs["talk"]),
                     lambda: draw.choice(pool), random.Random(19), repeats=1, p_system=P_SYSTEM["tune"], others=tune)
    # the questions the rules make of every corpus line, less those a tune dialog or a held-out dialog asks
    written = {key(q) for pairs in tune.values() for q, _ in pairs}
    # (not the replies that answer yes or no, or speak of the model itself: they state no fact of a line)
    replies = [a for f in ("en", "ru", "facts") for _, a in dialogs[f]
               if not a.startswith(("Yes,", "No,", "Да,", "Нет,", "I ", "Я ", "My ", "Меня "))]
    made = {lang: [(q, a) for q, a in pairs if key(q) not in written | heldout_keys]
            for lang, pairs in corpus_questions(HERE / "pretrain", replies).items()}
    # asked together, PACKED to a conversation (a conversation costs a training row however short it is):
    # the paraphrases no conversation above asks (the small talk's and the facts' all of them), the fact
    # questions, the made questions and N_MADE_PARAPHRASES paraphrases of each (a lead-in, the casual form)
    asked = {q for pairs in base.values() for q, _ in pairs}
    facts = by_language(dialogs["facts"])
    together = {lang: [p for q, _ in tune[lang] for p in reworded[q][1 if q in asked else 0:]] + facts[lang] + pairs
                + [(p, a) for q, a in pairs
                   for p in sample(rng, [p for p in paraphrases(q, lang) if key(p) not in heldout_keys | written],
                                   N_MADE_PARAPHRASES)]
                for lang, pairs in made.items()}
    chats += packed(together, lambda: draw.choice(pool), random.Random(17), P_SYSTEM["packed"])
    random.Random(13).shuffle(chats)
    asked_heldout = [m["content"] for c in chats for m in c["messages"]
                     if m["role"] == "user" and key(m["content"]) in heldout_keys]
    if asked_heldout:
        raise SystemExit(f"error: the tune data asks a held-out question: {asked_heldout[0]!r}; "
                         "the held-out split must stay unseen")
    write_jsonl(HERE / "tune/chat.jsonl", chats)
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
