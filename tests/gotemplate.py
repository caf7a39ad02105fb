"""A small interpreter of the part of Go's text/template that clgpt's Ollama TEMPLATE uses, with Go's rules:
`{{- ` trims all whitespace before the action, ` -}}` all whitespace after it; `if`/`else`/`end`,
`range` (dot becomes each element), field access `.Name`, `eq`/`ne` against a string literal; an empty
string, list or missing value is false. Anything else raises, so the template cannot silently grow past
what this checks. (Compared once with Go 1.19's text/template on the same data: identical output.)
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.S)


def _lex(template: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", s)] with the trim markers applied to the neighbouring text."""
    parts: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(template):
        text = template[pos : m.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        parts.append(("text", text))
        parts.append(("action", m.group(2)))
        pos, trim_next = m.end(), bool(m.group(3))
    text = template[pos:]
    parts.append(("text", text.lstrip(" \t\r\n") if trim_next else text))
    return parts


def _parse(parts, i=0, stop=("end",)):
    """-> (nodes, index of the stopping action, its text)."""
    nodes = []
    while i < len(parts):
        kind, s = parts[i]
        if kind == "text":
            nodes.append(("text", s))
            i += 1
            continue
        word = s.split(" ", 1)[0]
        if word in stop:
            return nodes, i, s
        if word in ("if", "range"):
            body, i, end = _parse(parts, i + 1, ("end", "else"))
            other = []
            if end.startswith("else"):
                if word != "if" or end != "else":
                    raise ValueError(f"unsupported action {end!r}")
                other, i, end = _parse(parts, i + 1, ("end",))
            nodes.append((word, s.split(" ", 1)[1], body, other))
            i += 1
            continue
        if not s.startswith("."):
            raise ValueError(f"unsupported action {s!r}")
        nodes.append(("field", s))
        i += 1
    if stop != ("end",) or i < len(parts):
        raise ValueError("unclosed action")
    return nodes, i, ""


def _value(expr: str, dot):
    expr = expr.strip()
    m = re.fullmatch(r'(eq|ne) (\.\w*) "([^"]*)"', expr)
    if m:
        equal = _value(m.group(2), dot) == m.group(3)
        return equal if m.group(1) == "eq" else not equal
    if re.fullmatch(r"\.\w+", expr):
        return dot.get(expr[1:]) if isinstance(dot, dict) else None
    if expr == ".":
        return dot
    raise ValueError(f"unsupported expression {expr!r}")


def _run(nodes, dot, out: list[str]) -> None:
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "field":
            v = _value(node[1], dot)
            out.append("<no value>" if v is None else str(v))
        elif node[0] == "if":
            _run(node[2] if _value(node[1], dot) else node[3], dot, out)
        else:  # range
            for item in _value(node[1], dot) or []:
                _run(node[2], item, out)


def render(template: str, data: dict) -> str:
    nodes, _, _ = _parse(_lex(template))
    out: list[str] = []
    _run(nodes, data, out)
    return "".join(out)
