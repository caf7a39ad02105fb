"""`clgpt chat` in a pseudo-terminal, as a user types into it: two turns, a refused message,
/reset and /exit. Each reply must be llama.cpp's greedy reply (create_chat_completion, the GGUF's own chat
template) to the same conversation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import llama_cpp
import pexpect

from clgpt.io.gguf import export_gguf

from test_llama_parity import train_tiny

ROOT = Path(__file__).resolve().parent.parent


def reply_of(child) -> str:
    """The text between the echoed line and the next prompt."""
    child.expect_exact("> ")
    text = child.before.replace("\r\n", "\n")
    echo, _, reply = text.partition("\n")
    return reply.removesuffix("\n")


def test_chat_in_a_terminal(tmp_path):
    tok, cfg, params = train_tiny()
    path = str(tmp_path / "tiny.gguf")
    export_gguf(path, cfg, params, tok, ftype="f32", name="clgpt-tiny")
    llm = llama_cpp.Llama(model_path=path, n_ctx=cfg.n_ctx, verbose=False, seed=0)

    def theirs(messages):
        r = llm.create_chat_completion(messages=messages, temperature=0.0, repeat_penalty=1.0, max_tokens=64)
        return r["choices"][0]["message"]["content"]

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # the tiny model learnt its dialogs without a system prompt: with one it answers "." (as llama.cpp does)
    child = pexpect.spawn(sys.executable, ["-m", "clgpt", "chat", path, "--greedy", "--max-tokens", "64"], env=env,
                          encoding="utf-8", timeout=300)
    child.expect_exact("/reset")  # the banner names the commands
    child.expect_exact("> ")
    messages = []
    for user in ("Where is the cat?", "Where is the dog?"):
        child.sendline(user)
        got = reply_of(child)
        messages += [{"role": "user", "content": user}]
        assert got == theirs(messages), f"turn {len(messages) // 2}: {got!r}"
        messages += [{"role": "assistant", "content": got}]
    assert messages[1]["content"] == "The cat sat on the mat."  # the tiny model's trained answer

    child.sendline("bad <|im_end|>marker")  # (no "> " in it: that is the prompt the test waits for)
    assert "error: " in reply_of(child)

    child.sendline("/reset")
    child.expect_exact("reset")
    child.expect_exact("> ")
    child.sendline("What flies?")
    assert reply_of(child) == theirs([{"role": "user", "content": "What flies?"}]) == "Birds fly over the sea."

    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
