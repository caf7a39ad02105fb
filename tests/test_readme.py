"""The README's commands use only flags the tools accept: llama.cpp's against its argument table (as vendored
in llama-cpp-python 0.3.36, tests/llama_cpp_flags.json, written by bench/llama_cpp_flags.py; the llama.cpp
binaries are not installed here, so this checks the flags, not a run), clgpt's against its own parser."""

import json
import shlex
from pathlib import Path

import pytest

from clgpt.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
FLAGS = json.loads((ROOT / "tests" / "llama_cpp_flags.json").read_text(encoding="utf-8"))


def readme_commands(program: str, inline: bool = True) -> list[list[str]]:
    """The README's shell lines (continuations joined) that run `program`, split as the shell would, and
    with `inline` its `inline code` that does."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("sh\n")]
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    cmds = [shlex.split(line) for line in lines if line.split(" ", 1)[0] == program]
    if inline:
        cmds += [shlex.split(c) for c in _inline(text) if c.split(" ", 1)[0] == program]
    return cmds


def _inline(text: str) -> list[str]:
    return [c for c in text.split("`")[1::2] if "\n" not in c]


@pytest.mark.parametrize("tool", ["llama-cli", "llama-server"])
def test_readme_llama_cpp_commands_use_accepted_flags(tool):
    cmds = readme_commands(tool)
    assert cmds, f"the README shows no {tool} command"
    for cmd in cmds:
        for arg in cmd[1:]:
            if arg.startswith("-"):
                assert arg in FLAGS[tool], f"{' '.join(cmd)}: {tool} has no flag {arg}"
    assert any(cmd[1:] == ["-m", "model.gguf"] for cmd in cmds)


def test_conversation_flag_is_not_a_llama_cli_flag():
    """`-cnv` moved to llama-completion; llama-cli converses by default (issue 13)."""
    assert "-cnv" not in FLAGS["llama-cli"] and "-cnv" in FLAGS["llama-completion"]


def test_readme_clgpt_commands_parse():
    cmds = readme_commands("clgpt", inline=False)
    assert any("--system" in c for c in cmds)
    for cmd in cmds:
        build_parser().parse_args(cmd[1:])
