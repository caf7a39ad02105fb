"""How many tune dialogs the exported model answers word for word in llama.cpp, through the GGUF's own
chat template (issue: at least 90% for the default run). Needs the test extra (llama-cpp-python).

    python bench/llama_exact_match.py model.gguf data/tune/*.jsonl
"""

import argparse
import sys

import llama_cpp

from clgpt.data import read_dialogs


def chat_answers(gguf: str, questions: list[str], max_tokens: int = 48) -> list[str]:
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=0, verbose=False, seed=0)
    out = []
    for q in questions:
        r = llm.create_chat_completion(
            messages=[{"role": "user", "content": q}], temperature=0.0, repeat_penalty=1.0, max_tokens=max_tokens
        )
        out.append(r["choices"][0]["message"]["content"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("dialogs", nargs="+")
    args = ap.parse_args(argv)
    dialogs = read_dialogs(args.dialogs)
    answers = chat_answers(args.gguf, [d["user"] for d in dialogs])
    hits = 0
    for d, a in zip(dialogs, answers):
        ok = a.strip() == d["assistant"].strip()
        hits += ok
        if not ok:
            print(f"MISS {d['user']!r}: got {a!r}, expected {d['assistant']!r}", file=sys.stderr)
    print(f"llama.cpp exact match: {hits}/{len(dialogs)} = {hits / len(dialogs):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
