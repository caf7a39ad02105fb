"""The figures of issue 47's table from one evaluation: tune replies word for word, held-out replies that carry
the expected fact or act (by language), and the held-out replies of the first 16 held-out dialogs and the
conversations built on them (112 replies: the held-out set as it was before the everyday openers) word for word.

    python bench/heldout_figures.py results/eval/metrics.json data/heldout/tune.jsonl [--first 16] \
        [--written data/tune/en.jsonl data/tune/ru.jsonl]

--written: also the tune replies to the questions of those files (the hand-written ones, not their paraphrases or
the small talk), in every conversation that asks them, word for word.
"""

from __future__ import annotations

import argparse
import json

from clgpt.data import read_dialogs


def earlier_replies(metrics: dict, heldout: str, first: int) -> tuple[int, int]:
    """(matches, total) over the answers to the dialogs that ask no held-out question but the first `first`."""
    dialogs = read_dialogs([heldout])
    singles = [d["messages"][0]["content"] for d in dialogs
               if [m["role"] for m in d["messages"]] == ["user", "assistant"]]
    later = set(singles[first:])
    answers = iter(metrics["answers"]["heldout"])
    ok = total = 0
    for d in dialogs:
        old = not any(m["role"] == "user" and m["content"] in later for m in d["messages"])
        for m in d["messages"]:
            if m["role"] == "assistant":
                a = next(answers)
                if old:
                    ok, total = ok + a["match"], total + 1
    if next(answers, None) is not None:
        raise SystemExit(f"error: {heldout} is not the held-out file these metrics answered; pass that one")
    return ok, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics")
    ap.add_argument("heldout")
    ap.add_argument("--first", type=int, default=16)
    ap.add_argument("--written", nargs="+", help="dialog files whose questions' tune replies to count apart")
    args = ap.parse_args(argv)
    with open(args.metrics, encoding="utf-8") as f:
        m = json.load(f)
    t = m["exact_match"]["tune"]
    print(f"tune replies word for word: {t['matches']}/{t['total']}")
    if args.written:
        asked = {d["messages"][0]["content"] for d in read_dialogs(args.written)}
        mine = [a for a in m["answers"]["tune"] if a["user"] in asked]
        print(f"tune replies to the questions of {' '.join(args.written)} word for word: "
              f"{sum(a['match'] for a in mine)}/{len(mine)}")
    acc = m.get("acceptable")
    if acc:
        langs = ", ".join(f"{k} {v['all']['matches']}/{v['all']['total']}" for k, v in acc["by_language"].items())
        print(f"held-out replies acceptable: {acc['all']['matches']}/{acc['all']['total']} "
              f"({100 * acc['all']['rate']:.1f}%; {langs})")
    ok, total = earlier_replies(m, args.heldout, args.first)
    print(f"held-out replies of the first {args.first} dialogs word for word: {ok}/{total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
