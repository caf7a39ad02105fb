"""The README's and docs/'s commands are ones the tools accept: clgpt's against its own parser, snakemake's against
snakemake's parser and this workflow's rules and outputs, llama.cpp's against its argument table (as vendored in
llama-cpp-python 0.3.36, tests/llama_cpp_flags.json, written by bench/llama_cpp_flags.py; the llama.cpp binaries are
not installed here, so this checks the flags, not a run), and every file of this repository a command names exists."""

import glob
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

from clgpt.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
FLAGS = json.loads((ROOT / "tests" / "llama_cpp_flags.json").read_text(encoding="utf-8"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Programs the docs may show, each checked below or named here as not ours to check (installers, other tools).
CHECKED = {"clgpt", "snakemake", "llama-cli", "llama-server"}
OTHERS = {"pip", "pytest", "bash", "python", "python3", "mpiexec", "ollama", "lms", "sacct", "srun", "module",
          "OMPI_ALLOW_RUN_AS_ROOT=1"}
REPO_PATH = re.compile(r"^(bench|scripts|configs|profiles|data|tests|rules|schemas|kernels|docs|\.ci)/")


def _shell_lines(text: str) -> list[str]:
    """The shell lines of a page's ```sh blocks, continuations joined."""
    blocks = [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("sh\n")]
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _inline(text: str) -> list[str]:
    return [c for c in text.split("`")[1::2] if "\n" not in c]


def doc_commands(program: str, inline: bool = True, pages=DOCS) -> list[tuple[str, list[str]]]:
    """(page, argv) of every shell line that runs `program`, split as the shell would, and with `inline` every
    `inline code` that does."""
    cmds = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        lines = _shell_lines(text) + (_inline(text) if inline else [])
        for line in lines:
            if line.split(" ", 1)[0] == program:
                cmds.append((page.name, shlex.split(line, comments=True)))
    return cmds


def readme_commands(program: str, inline: bool = True) -> list[list[str]]:
    return [cmd for _, cmd in doc_commands(program, inline, pages=[ROOT / "README.md"])]


def test_docs_are_the_pages_the_readme_links():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 260, "README.md is a guide of at most about 250 lines; move detail to docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", readme))
    pages = {f"docs/{p.name}" for p in DOCS[1:]}
    assert pages and pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    for page in linked:
        assert (ROOT / page).is_file(), f"README.md links {page}, which does not exist"


def test_every_shell_line_runs_a_program_we_check_or_know():
    for page in DOCS:
        for line in _shell_lines(page.read_text(encoding="utf-8")):
            program = line.split()[0]
            assert program in CHECKED | OTHERS, f"{page.name}: `{line}`: {program} is checked by no test"


@pytest.mark.parametrize("tool", ["llama-cli", "llama-server"])
def test_readme_llama_cpp_commands_use_accepted_flags(tool):
    cmds = doc_commands(tool)
    assert cmds, f"the docs show no {tool} command"
    for page, cmd in cmds:
        for arg in cmd[1:]:
            if arg.startswith("-"):
                assert arg in FLAGS[tool], f"{page}: {' '.join(cmd)}: {tool} has no flag {arg}"
    assert any(cmd[1:] == ["-m", "model.gguf"] for cmd in readme_commands(tool))


def test_conversation_flag_is_not_a_llama_cli_flag():
    """`-cnv` moved to llama-completion; llama-cli converses by default (issue 13)."""
    assert "-cnv" not in FLAGS["llama-cli"] and "-cnv" in FLAGS["llama-completion"]


def test_readme_clgpt_commands_parse():
    assert any("--system" in c for c in readme_commands("clgpt", inline=False))
    parser = build_parser()
    commands = {a.dest: a for a in parser._actions if a.dest == "command"}["command"].choices
    cmds = doc_commands("clgpt")
    assert len(cmds) >= 5
    for page, cmd in cmds:
        if len(cmd) == 2:  # `clgpt generate` named in a sentence: the command exists
            assert cmd[1] in commands, f"{page}: {' '.join(cmd)}: clgpt has no command {cmd[1]}"
        else:
            parser.parse_args(cmd[1:])


@lru_cache(maxsize=1)
def _snakemake_parser():
    from snakemake.cli import get_argument_parser

    return get_argument_parser()


def _workflow_targets() -> set[str]:
    """Rule names and the literal output paths of this workflow's rules."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))])
    rules = set(re.findall(r"^(?:rule|use rule \w+ as) (\w+)", text, flags=re.M))
    outputs = set(re.findall(r'^\s+(?:\w+=)?"([^"{}]+)"', text, flags=re.M))
    return rules | outputs


def test_docs_snakemake_commands_parse_and_name_this_workflows_targets():
    cmds = doc_commands("snakemake")
    assert len(cmds) >= 5
    targets = _workflow_targets()
    assert {"model.gguf", "hf", "sweep", "tune"} <= targets
    for page, cmd in cmds:
        args = _snakemake_parser().parse_args(cmd[1:])
        named = set(args.targets or []) | set(args.forcerun or []) | set(args.until or [])
        for target in named:
            assert target in targets, f"{page}: {' '.join(cmd)}: {target} is no rule or output of the Snakefile"
        for path in (args.configfile or []):
            assert (ROOT / path).is_file(), f"{page}: {' '.join(cmd)}: {path} does not exist"
        for profile in ([args.profile] if isinstance(args.profile, str) else args.profile or []):
            assert (ROOT / profile / "config.yaml").is_file(), f"{page}: {' '.join(cmd)}: no profile {profile}"


def test_docs_commands_name_files_that_exist():
    for page in DOCS:
        for line in _shell_lines(page.read_text(encoding="utf-8")):
            for word in shlex.split(line, comments=True):
                if REPO_PATH.match(word):
                    assert glob.glob(str(ROOT / word)), f"{page.name}: `{line}`: {word} does not exist"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_pages_reach_a_file_and_heading():
    for page in [*DOCS, ROOT / "ARCHITECTURE.md"]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: link {target}: {path} does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{page.name}: link {target}: no such heading"


def test_docs_pip_installs_name_extras_pyproject_has():
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"])
    cmds = doc_commands("pip")
    assert cmds
    for page, cmd in cmds:
        for word in cmd[2:]:
            named = re.fullmatch(r"\.\[([\w,-]+)\]", word)
            if named:
                for extra in named.group(1).split(","):
                    assert extra in extras, f"{page}: {' '.join(cmd)}: pyproject.toml has no extra {extra}"
