"""How often the exported model answers its tune questions word for word in llama.cpp (llama-cpp-python),
in a real chat: after a system prompt, and as the 2nd and 3rd turn of a conversation (issue 13: at least
90% each), through both of llama.cpp's chat paths:

- jinja:   `create_chat_completion`, which renders the GGUF's Jinja `tokenizer.chat_template`;
- builtin: `llama_chat_apply_template` on the GGUF's template (llama.cpp's own template engine, the one
           `llama-cli` and `llama-server --no-jinja` use), then greedy generation until EOS/EOT.

The questions are the single-turn dialogs of the given files; the system prompts are those the files'
conversations use with questions of the same file (clgpt.text.chat.chat_probes builds the conversations).
With --heldout, also the same questions after the system prompts that only the held-out dialogs use
(clgpt.text.chat.system_probes: first turn, and 2nd or 3rd), one line and paragraph ones apart.
Needs the test extra (llama-cpp-python).

    python bench/llama_exact_match.py model.gguf data/tune/*.jsonl --heldout data/heldout/tune.jsonl \
        --ask data/tune/en.jsonl data/tune/ru.jsonl      (the 87 hand-written questions, not their paraphrases)
    python bench/llama_exact_match.py lora/base.gguf --lora lora/adapter.gguf data/tune/*.jsonl   (tune.lora)
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import llama_cpp

from clgpt.data import read_dialogs
from clgpt.text.chat import PARAGRAPH_WORDS, PROBE_KINDS, chat_probes, heldout_systems, system_probes

PATHS = ("jinja", "builtin")


def jinja_reply(llm, messages: list[dict], max_tokens: int) -> str:
    r = llm.create_chat_completion(messages=messages, temperature=0.0, repeat_penalty=1.0, max_tokens=max_tokens)
    return r["choices"][0]["message"]["content"]


def builtin_prompt(llm, messages: list[dict], template: bytes) -> bytes:
    """llama.cpp's built-in rendering of `messages` with the GGUF's template (with the assistant prefix)."""
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages])
    size = 1024 + 2 * sum(len(m["content"].encode()) + 32 for m in messages)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template, chat, len(messages), True, buf, size)
    if n < 0:
        raise RuntimeError("llama_chat_apply_template: this template is not supported by llama.cpp's built-in engine")
    return buf.raw[:n]


def builtin_reply(llm, messages: list[dict], max_tokens: int, template: bytes) -> str:
    ids = llm.tokenize(builtin_prompt(llm, messages, template), add_bos=True, special=True)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out = []
    for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if llama_cpp.llama_vocab_is_eog(vocab, t) or len(out) == max_tokens or len(ids) + len(out) >= llm.n_ctx():
            break
        out.append(t)
    return llm.detokenize(out).decode("utf-8", errors="replace")


def chat_answers(gguf: str, questions: list[str], max_tokens: int = 48) -> list[str]:
    """llama.cpp's replies (Jinja path) to single user questions."""
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=0, verbose=False, seed=0)
    return [jinja_reply(llm, [{"role": "user", "content": q}], max_tokens) for q in questions]


def run_probes(gguf: str, probes: list, max_tokens: int = 48, lora: str | None = None) -> dict:
    """{path: [(kind, expected, answer)]} for each chat path; lora: an adapter GGUF llama.cpp adds to gguf."""
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=0, verbose=False, seed=0, lora_path=lora)
    template = llm.metadata["tokenizer.chat_template"].encode()
    replies = {"jinja": lambda m: jinja_reply(llm, m, max_tokens),
               "builtin": lambda m: builtin_reply(llm, m, max_tokens, template)}
    results = {}
    for path, reply in replies.items():
        rows = []
        for kind, opening, questions, expected in probes:
            messages = list(opening)
            for q in questions:  # a real chat: each earlier reply is the model's own
                messages.append({"role": "user", "content": q})
                messages.append({"role": "assistant", "content": reply(messages)})
            rows.append((kind, expected, messages[-1]["content"]))
        results[path] = rows
    return results


HELDOUT_KINDS = ("paragraph first", "paragraph later", "line first", "line later")


def rates(rows: list, kinds: tuple = PROBE_KINDS) -> dict:
    """{kind: (matches, total)}."""
    out = {}
    for kind in kinds:
        hits = [answer.strip() == expected.strip() for k, expected, answer in rows if k == kind]
        out[kind] = (sum(hits), len(hits))
    return out


def corpus_probes(files: list[str], ask: list[str] | None = None) -> list:
    """chat_probes per file (of `ask` when given, else of all): its single-turn dialogs, with the system
    prompts that the files' conversations use with those questions."""
    probes = []
    dialogs = read_dialogs(files)
    for path in ask or files:
        mine = [d for d in dialogs if d["source"].rsplit(":", 1)[0] == path]
        pairs = [(d["messages"][0]["content"], d["messages"][1]["content"])
                 for d in mine if len(d["messages"]) == 2]
        if not pairs:
            continue
        questions = {q for q, _ in pairs}
        systems = sorted({d["messages"][0]["content"] for d in dialogs if d["messages"][0]["role"] == "system"
                          and any(m["role"] == "user" and m["content"] in questions for m in d["messages"])})
        probes += chat_probes(pairs, systems)
    return probes


def heldout_system_probes(files: list[str], heldout: str, ask: list[str] | None = None) -> list:
    """system_probes of the single-turn dialogs of the files (of `ask` when given) after the held-out file's
    own system prompts, each kind prefixed by the prompt's length ("paragraph" or "line")."""
    dialogs = read_dialogs(files)
    pairs = [(d["messages"][0]["content"], d["messages"][1]["content"])
             for d in (read_dialogs(ask) if ask else dialogs)
             if [m["role"] for m in d["messages"]] == ["user", "assistant"]]
    systems = heldout_systems(dialogs, read_dialogs([heldout]))
    if not systems:
        raise SystemExit(f"error: {heldout}: no system prompt that the tune dialogs do not use; add held-out ones")
    return [(("paragraph " if len(opening[0]["content"].split()) >= PARAGRAPH_WORDS else "line ") + kind, opening,
             questions, expected) for kind, opening, questions, expected in system_probes(pairs, systems)]


def print_rates(results: dict, kinds: tuple, show_misses: bool) -> None:
    print(f"{'path':<8} " + " ".join(f"{k:>16}" for k in kinds))
    for path, rows in results.items():
        r = rates(rows, kinds)
        print(f"{path:<8} " + " ".join(f"{m:>4}/{n:<4} {100 * m / max(n, 1):5.1f}%" for m, n in r.values()))
        if show_misses:
            for kind, expected, answer in rows:
                if answer.strip() != expected.strip():
                    print(f"  MISS {path} {kind}: got {answer!r}, expected {expected!r}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("dialogs", nargs="+")
    ap.add_argument("--lora", help="a LoRA adapter GGUF to apply to the model (llama.cpp's --lora)")
    ap.add_argument("--show-misses", action="store_true")
    ap.add_argument("--heldout", help="held-out dialogs: also ask the questions after their own system prompts")
    ap.add_argument("--ask", nargs="+", help="ask only the single-turn dialogs of these of the files (e.g. the "
                    "hand-written ones, not their paraphrases); the system prompts still come from all")
    args = ap.parse_args(argv)
    print_rates(run_probes(args.gguf, corpus_probes(args.dialogs, args.ask), lora=args.lora), PROBE_KINDS,
                args.show_misses)
    if args.heldout:
        print("after held-out system prompts:")
        print_rates(run_probes(args.gguf, heldout_system_probes(args.dialogs, args.heldout, args.ask), lora=args.lora),
                    HELDOUT_KINDS, args.show_misses)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
