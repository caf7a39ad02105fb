"""Writes tests/llama_cpp_flags.json: the command-line flags that llama-cli, llama-server and llama-completion
accept, read from llama.cpp's argument table (`common/arg.cpp`), for tests/test_readme.py to check the
README's commands against. Run it on the llama.cpp source that llama-cpp-python vendors (the test extra's
version) when that version changes:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xf llama_cpp_python-0.3.36.tar.gz
    python bench/llama_cpp_flags.py llama_cpp_python-0.3.36/vendor/llama.cpp
"""

import json
import re
import sys
from pathlib import Path

TOOLS = {"llama-cli": "LLAMA_EXAMPLE_CLI", "llama-server": "LLAMA_EXAMPLE_SERVER",
         "llama-completion": "LLAMA_EXAMPLE_COMPLETION"}


def tool_flags(arg_cpp: str) -> dict[str, list[str]]:
    """{tool: sorted flags}. An option with no set_examples is common to every tool; set_excludes removes tools."""
    out = {tool: set() for tool in TOOLS}
    for block in arg_cpp.split("add_opt(common_arg(")[1:]:
        block = block.split("add_opt(", 1)[0]
        names = []
        for group in re.findall(r"\{((?:\s*\"-[^\"]*\"\s*,?)+)\}", block.split("[](", 1)[0]):
            names += re.findall(r"\"(-[^\"]*)\"", group)
        ex = re.search(r"set_examples\(\{([^}]*)\}", block)
        examples = set(re.findall(r"LLAMA_EXAMPLE_\w+", ex.group(1))) if ex else {"LLAMA_EXAMPLE_COMMON"}
        exc = re.search(r"set_excludes\(\{([^}]*)\}", block)
        excludes = set(re.findall(r"LLAMA_EXAMPLE_\w+", exc.group(1))) if exc else set()
        for tool, example in TOOLS.items():
            if ("LLAMA_EXAMPLE_COMMON" in examples or example in examples) and example not in excludes:
                out[tool].update(names)
    return {tool: sorted(flags) for tool, flags in out.items()}


def main() -> None:
    src = Path(sys.argv[1]) / "common" / "arg.cpp"
    flags = tool_flags(src.read_text(encoding="utf-8"))
    out = Path(__file__).resolve().parent.parent / "tests" / "llama_cpp_flags.json"
    out.write_text(json.dumps({"source": "llama.cpp common/arg.cpp as vendored in llama-cpp-python 0.3.36",
                               **flags}, indent=0) + "\n", encoding="utf-8")
    print({tool: len(f) for tool, f in flags.items()})


if __name__ == "__main__":
    main()
