"""Text as it is generated, and `clgpt chat`: a multi-turn conversation in the terminal, as llama-cli holds one.

Streaming: each token's bytes go through an incremental UTF-8 decoder and out at once (flushed), so a character
that a byte-level token splits appears whole when its last byte comes, never as U+FFFD halves.

The chat keeps the conversation as token ids (the system prompt, then each exchange: the user's ChatML block and
the reply's tokens as generated, closed by `<|im_end|>`), as llama-cli does, and asks for each reply with the
whole conversation as the prompt (clgpt.text.chat's ChatML: what `clgpt generate --chat` and llama.cpp's template
render for the same messages). When the next prompt would not leave `min(max_tokens, n_ctx / 4)` positions for
the reply, the oldest exchanges are dropped (the system prompt stays). Commands: `/reset` starts over with the
same system prompt, `/exit` (or end of input) leaves; Ctrl-C stops a reply, and at the prompt leaves.
"""

from __future__ import annotations

import codecs
import sys
from collections.abc import Iterable

from clgpt.errors import ClgptError

HELP = "/reset starts over, /exit leaves (Ctrl-C stops a reply)"


def sampling_settings(args, eog: Iterable[int]) -> dict:
    """Generator.stream's keywords from the sampling options (cli._sampling_options): stop at the GGUF's
    end-of-generation tokens, or with --ignore-eos never draw them (llama.cpp sets their logits to -inf)."""
    eog = sorted(eog)
    return dict(max_tokens=args.max_tokens, greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, stop_ids=() if args.ignore_eos else eog,
                suppress_ids=eog if args.ignore_eos else ())


def stream_text(tok, ids: Iterable[int], out) -> list[int]:
    """Write the text of ids to `out` as they come, flushing after each; bytes of an unfinished UTF-8 character
    wait for the rest (at the end a truncated one prints as U+FFFD, as tok.decode would). -> the ids."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    seen = []
    try:
        for i in ids:
            seen.append(i)
            text = dec.decode(tok.token_bytes(i))
            if text:
                out.write(text)
                out.flush()
    finally:
        out.write(dec.decode(b"", final=True))
        out.flush()
    return seen


class Conversation:
    """The token ids of a chat: BOS and the system block, then (user block, reply) exchanges."""

    def __init__(self, tok, system: str | None):
        from clgpt.text.chat import encode_chat

        self.tok = tok
        msgs = [{"role": "system", "content": system}] if system else []
        if msgs:
            from clgpt.text.chat import check_messages

            check_messages(msgs + [{"role": "user", "content": "x"}], "--system", prompt=True)
        self.head = encode_chat(tok, msgs)[0]  # [BOS] (+ the system block and "\n")
        self.newline = tok.encode("\n")
        self.exchanges: list[tuple[list[int], list[int]]] = []

    def reset(self) -> None:
        self.exchanges = []

    def prompt(self, user_block: list[int]) -> list[int]:
        ids = list(self.head)
        for u, r in self.exchanges:
            ids += u + r + [self.tok.im_end_id] + self.newline
        return ids + user_block

    def user_block(self, text: str) -> list[int]:
        """`<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` (a ClgptError for a bad message)."""
        from clgpt.text.chat import check_messages, encode_chat

        msgs = check_messages([{"role": "user", "content": text}], "message", prompt=True)
        return encode_chat(self.tok, msgs, add_generation_prompt=True)[0][1:]  # without BOS


def run_chat(args, stdin=None, stdout=None, stderr=None, *, knobs) -> None:
    from clgpt.device.opencl import decode_device
    from clgpt.inference.generate import Generator, eog_ids
    from clgpt.io.gguf import read_gguf

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    cfg, params, tok, kv = read_gguf(args.model)
    conv = Conversation(tok, args.system)
    if len(conv.head) >= cfg.n_ctx // 2:
        raise ClgptError(f"--system: the system prompt is {len(conv.head)} tokens, half or more of the model's "
                         f"context ({cfg.n_ctx}); shorten it")
    settings = sampling_settings(args, eog_ids(kv))
    gen = Generator(cfg, params, device=decode_device(args.device), knobs=knobs)
    room = max(1, min(args.max_tokens, cfg.n_ctx // 4))  # positions kept free for a reply
    print(f"clgpt chat: {args.model} ({cfg.arch}, context {cfg.n_ctx} tokens). {HELP}", file=stderr, flush=True)
    turn = 0
    while True:
        stdout.write("> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            return
        if not line:  # end of input
            stdout.write("\n")
            return
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command == "/exit":
            return
        if command == "/reset":
            conv.reset()
            print("(conversation reset)", file=stderr, flush=True)
            continue
        if command.startswith("/") and " " not in command:
            print(f"unknown command {command}: {HELP}", file=stderr, flush=True)
            continue
        try:
            block = conv.user_block(text)
        except ClgptError as e:
            print(f"error: {e}", file=stderr, flush=True)
            continue
        while conv.exchanges and len(conv.prompt(block)) + room > cfg.n_ctx:
            conv.exchanges.pop(0)
            print("(context full: the oldest exchange is forgotten)", file=stderr, flush=True)
        ids = conv.prompt(block)
        if len(ids) >= cfg.n_ctx:
            print(f"error: this message makes the prompt {len(ids)} tokens, the model's context is {cfg.n_ctx}; "
                  "write a shorter one", file=stderr, flush=True)
            continue
        reply: list[int] = []
        try:
            stream_text(tok, _kept(gen.stream(ids, **{**settings, "seed": settings["seed"] + turn}), reply), stdout)
        except KeyboardInterrupt:
            pass  # the reply so far stays in the conversation
        stdout.write("\n")
        stdout.flush()
        conv.exchanges.append((block, reply))
        turn += 1



def _kept(stream, into: list[int]):
    """The token ids of a Generator stream, each appended to `into` as it passes (a reply cut by Ctrl-C keeps
    what came)."""
    for t, _ in stream:
        into.append(t)
        yield t
