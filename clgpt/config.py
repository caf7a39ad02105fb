"""config.yaml: read, merged and validated in one place, before Snakemake runs anything.

- Reading: YAML 1.2 scalars (the core schema), so `lr: 1e-3` is a float, `device: 1:0` is the text "1:0"
  (YAML 1.1, which PyYAML and Snakemake speak, reads it as the base-60 number 60) and `yes` is text, not
  true. Errors name the file and line: bad syntax, a tab indent, a byte that is not UTF-8, a key given twice.
- Merging: `config.yaml`, then each `--configfile` in order, then `--config KEY=VALUE`, as Snakemake merges
  them; a section whose keys are all commented out (`evaluate:` alone) is an empty section, not null.
- Validation: `schemas/config.schema.yaml` is the one source of settings and their defaults; the checks a
  schema cannot express (shapes that cannot work, keys that depend on each other) live in `check_config`.
  Every error is one line: `config.yaml:37: tune.lr: ...` naming the file, line and key and what to do.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import jsonschema
import yaml

from clgpt.errors import ClgptError
from clgpt.paths import data_path

SCHEMA_PATH = data_path("schemas") / "config.schema.yaml"
N_SPECIAL = 4  # <s> </s> <|im_start|> <|im_end|>
KeyPath = tuple  # a key path such as ("tune", "lr")


# ---- YAML 1.2 ----------------------------------------------------------------------------------

class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema plain scalars: ints are decimal, 0o octal or 0x hex
    (no base 60, no `_`); floats include `1e-3`; booleans are only true/false; no implicit timestamps."""

    def construct_mapping(self, node, deep=False):
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag.endswith(":str"):
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    raise _DuplicateKey(key_node.value, seen[key_node.value], line)
                seen[key_node.value] = line
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: int, line: int):
        self.key, self.first, self.line = key, first, line


_CORE = "tag:yaml.org,2002:"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag[len(_CORE):] not in ("bool", "int", "float", "null", "timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(_CORE + "null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
_Yaml12Loader.add_implicit_resolver(_CORE + "bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    _CORE + "int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Yaml12Loader.add_implicit_resolver(
    _CORE + "float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"),
)


def _construct_int(loader, node) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


def _construct_float(loader, node) -> float:
    text = loader.construct_scalar(node)
    if text.lower().endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text.lower() == ".nan":
        return math.nan
    return float(text)


_Yaml12Loader.add_constructor(_CORE + "int", _construct_int)
_Yaml12Loader.add_constructor(_CORE + "float", _construct_float)


def plain_scalar(text: str):
    """What YAML 1.2 makes of an unquoted scalar: `1e-3` -> 0.001, `true` -> True, `1:0` -> "1:0"."""
    loader = _Yaml12Loader("")
    try:
        node = yaml.ScalarNode(loader.resolve(yaml.ScalarNode, text, (True, False)), text)
        return loader.construct_object(node)
    finally:
        loader.dispose()


def _key_lines(node, path: KeyPath = ()) -> dict[KeyPath, int]:
    """{key path: 1-based line} of every mapping key in a composed YAML node tree."""
    out = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                sub = (*path, key.value)
                out[sub] = key.start_mark.line + 1
                out.update(_key_lines(value, sub))
    return out


def _mistake_mark(e: "yaml.MarkedYAMLError", text: str):
    """Where the mistake is, which YAML often finds a line later: a bracket or key left open (the line it was
    opened on, e.context_mark), or a key without its ':' before a line with one (that earlier line)."""
    problem, context = e.problem_mark, e.context_mark
    if problem is None or (context is not None and context.line < problem.line):
        return context or problem
    if "mapping values are not allowed" in str(e.problem or ""):
        lines = text.splitlines()
        for n in range(problem.line - 1, -1, -1):
            stripped = lines[n].split(" #")[0].strip()
            if stripped and not stripped.startswith("#"):
                if ":" not in stripped and not stripped.startswith("-"):
                    return yaml.Mark(problem.name, 0, n, len(lines[n]) - len(lines[n].lstrip()), None, None)
                break
    return problem


def _tab_indent_line(text: str, up_to: int) -> int | None:
    for n, line in enumerate(text.splitlines()[:up_to], start=1):
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        if "\t" in indent and line.strip() and not line.lstrip().startswith("#"):
            return n
    return None


def read_yaml(path: str | Path) -> tuple[Any, dict[KeyPath, int]]:
    """(the document, {key path: line}) of a YAML file read with YAML 1.2 scalars; None for an empty file
    (or one of comments only). ClgptError naming the file and line for anything unreadable."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ClgptError(f"{path}: config file not found; check the name (or --configfile path)") from None
    except IsADirectoryError:
        raise ClgptError(f"{path}: is a folder; give the config YAML file") from None
    except OSError as e:
        raise ClgptError(f"{path}: cannot read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ClgptError(
            f"{path}:{line}: byte 0x{raw[e.start]:02x} (offset {e.start}) is not UTF-8 (Latin-1?); "
            "re-save the file as UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")
    loader = _Yaml12Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except _DuplicateKey as e:
        raise ClgptError(f"{path}:{e.line}: key '{e.key}' is given twice (first on line {e.first}); keep one") from None
    except yaml.MarkedYAMLError as e:
        mark = _mistake_mark(e, text)
        line = mark.line + 1 if mark else len(text.splitlines())
        tab = _tab_indent_line(text, line)
        if tab is not None:
            raise ClgptError(f"{path}:{tab}: indented with a tab; YAML indents with spaces only, replace the tab") from None
        problem = " ".join(str(e.problem or e.context or "syntax error").split())
        if mark is not None and e.problem_mark is not None and mark.line != e.problem_mark.line:
            problem += f", noticed on line {e.problem_mark.line + 1}"
        col = f":{mark.column + 1}" if mark else ""
        raise ClgptError(f"{path}:{line}{col}: not valid YAML ({problem}); fix the syntax") from None
    except yaml.YAMLError as e:
        raise ClgptError(f"{path}: not valid YAML ({' '.join(str(e).split())}); fix the syntax") from None
    finally:
        loader.dispose()
    if data is not None and not isinstance(data, dict):
        raise ClgptError(
            f"{path}:1: expected sections (device:, tokenizer:, model:, ...) at the top level, "
            f"found {type(data).__name__}"
        )
    return data, (_key_lines(node) if node is not None else {})


# ---- the schema --------------------------------------------------------------------------------

_SCHEMA: dict | None = None


def load_schema() -> dict:
    global _SCHEMA
    if _SCHEMA is None:
        with open(SCHEMA_PATH, encoding="utf-8") as f:
            _SCHEMA = yaml.safe_load(f)
    return copy.deepcopy(_SCHEMA)


def defaults(section: str | None = None) -> dict:
    """The schema's defaults: of every section, or of one (`defaults("tune")["lr"]`)."""
    config = fill_defaults(load_schema(), {})
    return config if section is None else config[section]


def fill_defaults(schema: dict, value):
    """Fill `default`s of object properties, recursively (a missing or null section becomes its defaults)."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    for key, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and key in value and value[key] is None:
            value[key] = {}  # every key of the section commented out: an empty section
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = fill_defaults(sub, value[key])
    return value


class _Where:
    """Turns a key path into the error prefix: `config.yaml:37: tune.lr` (file and line known), else
    `SOURCE: tune.lr`."""

    def __init__(self, source: str, lines: Mapping[KeyPath, str] | None = None):
        self.source, self.lines = source, dict(lines or {})

    def __call__(self, path: Iterable) -> str:
        path = tuple(str(p) for p in path)
        key = _one_line(".".join(path)) or "(top level)"
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return f"{self.lines[path[:n]]}: {key}"
        return f"{self.source}: {key}" if self.source else key


def _one_line(text: str) -> str:
    """text with its control characters escaped (a quoted YAML key may hold a newline): messages stay one line."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TYPE_WORDS = {"number": "a number", "integer": "a whole number", "boolean": "true or false", "string": "text",
               "object": "a section of keys"}


def _message(e: jsonschema.ValidationError, where: _Where) -> str:
    path = list(e.absolute_path)
    v = e.instance
    if e.validator == "additionalProperties":
        allowed = sorted(e.schema.get("properties", {}))
        unknown = sorted(str(k) for k in set(e.instance) - set(allowed))[0]
        near = difflib.get_close_matches(unknown, allowed, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        full = _one_line(".".join(str(p) for p in (*path, unknown)))
        return f"{where((*path, unknown))}: unknown key '{full}'; {hint}allowed here: {', '.join(allowed)}"
    key = where(path)
    if e.validator == "type":
        want = e.validator_value
        if isinstance(want, list):  # e.g. [string, null]: the check is against the non-null type
            want = next((t for t in want if t != "null"), want[0])
        words = _TYPE_WORDS.get(want, want)
        if v is None:
            default = f" ({e.schema['default']!r})" if "default" in e.schema else ""
            return f"{key}: empty; give {words}, or remove the line to use the default{default}"
        if path == ["device"] and isinstance(v, (int, float)) and not isinstance(v, bool):
            fix = f"{int(v) // 60}:{int(v) % 60}" if isinstance(v, int) and v >= 60 else str(v)
            sexa = (f" (YAML 1.1 reads an unquoted {fix} as the base-60 number {v})"
                    if isinstance(v, int) and v >= 60 else "")
            return f'{key}: the number {v} is not a device{sexa}; quote it: device: "{fix}"'
        if want == "boolean" and isinstance(v, str):
            return f"{key}: {_short(v)} is not true or false; write true or false"
        if want in ("number", "integer") and isinstance(v, str):
            return f"{key}: {_short(v)} is not a number; write it like 0.001, 1e-3 or 300 (no quotes)"
        if want == "integer" and isinstance(v, float):
            return f"{key}: {v!r} is not a whole number; write an integer like 300"
        if want == "object":
            return f"{key}: expected a section (indented `key: value` lines below `{path[-1] if path else ''}:`), got {_short(v)}"
        return f"{key}: {_short(v)} is not {words}"
    if e.validator == "enum":
        return f"{key}: {_short(v)} is not one of {', '.join(map(str, e.validator_value))}"
    if e.validator == "minLength":
        return f"{key}: empty; give a non-empty value"
    return f"{key}: {' '.join(e.message.split())}"


def _coerce_and_check_numbers(schema: dict, value, path: list, where: _Where):
    """Whole floats (3.0) where the schema wants an integer become ints, ints where it wants a number
    become floats; inf and nan are refused."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for k, sub in schema.get("properties", {}).items():
            if k in value:
                value[k] = _coerce_and_check_numbers(sub, value[k], [*path, k], where)
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ClgptError(f"{where(path)}: {value} is not a finite number")
    if schema.get("type") == "integer" and isinstance(value, float):
        return int(value)
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _validate(schema: dict, value, path: list, where: _Where):
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(value), key=lambda e: (list(map(str, e.absolute_path)), e.validator))
    if errors:
        e = errors[0]
        e.path.extendleft(reversed(path))  # absolute_path is relative to the section validated
        raise ClgptError(_message(e, where))
    return _coerce_and_check_numbers(schema, value, path, where)


def validate_config(config: Mapping | None, source: str = "config.yaml", lines: Mapping[KeyPath, str] | None = None) -> dict:
    """A copy of `config` with defaults filled in; ClgptError (one line naming the key, and its file and
    line when `lines` maps key paths to "file:line") on any problem."""
    where = _Where(source, lines)
    if config is not None and not isinstance(config, Mapping):
        raise ClgptError(f"{source}: expected sections (device:, tokenizer:, model:, ...), found {type(config).__name__}")
    schema = load_schema()
    config = fill_defaults(schema, copy.deepcopy(dict(config or {})))
    config = _validate(schema, config, [], where)
    check_config(config, where)
    return config


def section_settings(section: str, settings: Mapping | None) -> dict:
    """One section's settings (e.g. a stage's `tune` dict) with the schema's defaults filled in and
    checked; the stage code calls this, so a value the pipeline never validated is still checked."""
    schema = load_schema()["properties"][section]
    where = _Where("")
    value = fill_defaults(schema, copy.deepcopy(dict(settings or {})))
    return _validate(schema, value, [section], where)


# ---- checks a schema cannot express ------------------------------------------------------------

def check_config(config: dict, where: _Where | None = None) -> None:
    """Shapes that pass the schema but cannot work, and keys that depend on each other."""
    where = where or _Where("config.yaml")
    m, tok = config["model"], config["tokenizer"]
    if m["n_embd"] % m["n_head"]:
        raise ClgptError(
            f"{where(['model', 'n_embd'])}: model.n_embd={m['n_embd']} is not divisible by model.n_head={m['n_head']}; "
            "choose n_embd a multiple of n_head"
        )
    _check_model(m, where)
    if m["arch"] == "gpt2" and m["n_ctx"] % 256:
        raise ClgptError(
            f"{where(['model', 'n_ctx'])}: model.n_ctx={m['n_ctx']} is not a multiple of 256; llama.cpp allocates "
            "positions in multiples of 256 and aborts past the table, so use 256, 512, ..."
        )
    if tok["vocab_size"] < 256 + N_SPECIAL:
        raise ClgptError(
            f"{where(['tokenizer', 'vocab_size'])}: tokenizer.vocab_size={tok['vocab_size']} is below 260 "
            "(256 bytes + 4 special tokens)"
        )
    # a stage's shape is checked where the stage runs: without dialogs (corpus.tune empty) there is no tune stage,
    # and the character recipes keep the default tune settings beside a shorter context
    for stage in ("pretrain", "tune") if config["corpus"].get("tune") else ("pretrain",):
        if config[stage]["ranks"] > config[stage]["batch_size"]:
            raise ClgptError(
                f"{where([stage, 'ranks'])}: {stage}.ranks={config[stage]['ranks']} is more than "
                f"{stage}.batch_size={config[stage]['batch_size']}: every rank needs at least one row of each "
                "micro-batch; lower ranks or raise batch_size"
            )
        if config[stage]["seq_len"] > m["n_ctx"]:
            raise ClgptError(
                f"{where([stage, 'seq_len'])}: {stage}.seq_len={config[stage]['seq_len']} is longer than "
                f"model.n_ctx={m['n_ctx']}; lower it or raise model.n_ctx"
            )
    lora = config["tune"].get("lora")
    if lora and lora.get("targets") == []:
        raise ClgptError(f"{where(['tune', 'lora', 'targets'])}: tune.lora.targets is empty, which would adapt "
                         "nothing; name the matrices to adapt (e.g. [attn_q, attn_v]) or leave the key out for all")
    if lora and not config["corpus"].get("tune"):
        raise ClgptError(f"{where(['tune', 'lora'])}: tune.lora is set but there is no tune stage (corpus.tune "
                         "is empty), so no adapter would be trained; set corpus.tune to a folder of chat files "
                         "or remove tune.lora")
    qtype = config["export"]["type"]
    if qtype in ("q8_0", "q4_0"):
        from clgpt.model import ModelConfig

        resolved = {"n_embd": m["n_embd"], "n_ff": ModelConfig.from_dict(m).n_ff}  # n_ff 0: the usual width
        for key in ("n_embd", "n_ff"):
            if resolved[key] % 32:
                raise ClgptError(
                    f"{where(['model', key])}: model.{key}={resolved[key]} is not a multiple of 32, which export.type={qtype} "
                    "needs (rows are quantized in blocks of 32); use f32/f16 or change the shape"
                )


def check_shapes(config: dict, source: str = "config.yaml") -> None:
    check_config(config, _Where(source))


def _check_model(m: dict, where: _Where) -> None:
    """ModelConfig.validate: for llama an even head dim (RoPE pairs), n_head_kv dividing n_head, a
    consistent expert count; for gpt2 none of the llama-only keys."""
    from clgpt.model import ModelConfig

    try:
        ModelConfig.from_dict(m).validate()
    except ClgptError as e:
        key = re.match(r"model\.(\w+): ", str(e))  # the message names its key: point at that key's line
        if key:
            raise ClgptError(f"{where(['model', key.group(1)])}: {str(e)[key.end():]}") from None
        raise ClgptError(f"{where(['model'])}: {e}") from None


# ---- loading -----------------------------------------------------------------------------------

def _merge(base: dict, over: Mapping, where: dict, over_where: Mapping, path: KeyPath = ()) -> None:
    """Snakemake's update_config (nested sections merge, other values replace), keeping each key's
    "file:line"; a null section in `over` (all its keys commented out) leaves `base`'s section alone."""
    for k, v in over.items():
        p = (*path, k)
        if p in over_where:
            where[p] = over_where[p]
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v, where, over_where, p)
        elif v is None and isinstance(base.get(k), dict):
            continue
        else:
            base[k] = copy.deepcopy(dict(v)) if isinstance(v, Mapping) else v
            for q in [q for q in where if q[: len(p)] == p and len(q) > len(p)]:
                del where[q]
            where.update({q: w for q, w in over_where.items() if q[: len(p)] == p and len(q) > len(p)})


def _yaml12_leaves(value):
    """--config values arrive as Snakemake parsed them (nested ones as YAML 1.1 strings); read text
    leaves again as YAML 1.2 plain scalars."""
    if isinstance(value, Mapping):
        return {k: _yaml12_leaves(v) for k, v in value.items()}
    if isinstance(value, str):
        return plain_scalar(value)
    return value


def load_workflow_config(main: str | None = "config.yaml", configfiles: Iterable = (), overrides: Mapping | None = None,
                         replace: bool = False, warn=None) -> dict:
    """The validated config of a run: `main` (the workflow's config.yaml; skipped when it is absent and
    --configfile files are given, or with --replace-workflow-config), each of `configfiles` in order, then
    `overrides` (--config). ClgptError naming file, line and key on any problem."""
    warn = warn or (lambda text: print(text, file=sys.stderr))
    files = [str(f) for f in configfiles]
    if main is not None and not (replace and files) and (Path(main).exists() or not files):
        files.insert(0, main)
    merged: dict = {}
    where: dict[KeyPath, str] = {}
    for path in files:
        data, lines = read_yaml(path)
        if data is None:
            warn(f"warning: {path} has no settings (empty, or only comments); every key takes its default "
                 f"from {SCHEMA_PATH.parent.name}/{SCHEMA_PATH.name}")
            continue
        _merge(merged, data, where, {p: f"{path}:{n}" for p, n in lines.items()})
    if overrides:
        cli = _yaml12_leaves(dict(overrides))
        _merge(merged, cli, where, {p: "--config" for p in _paths(cli)})
    return validate_config(merged, source=files[-1] if files else "config", lines=where)


def _paths(d: Mapping, path: KeyPath = ()) -> list[KeyPath]:
    out = []
    for k, v in d.items():
        out.append((*path, k))
        if isinstance(v, Mapping):
            out += _paths(v, (*path, k))
    return out


def load_config(path: str) -> dict:
    """The validated config of one YAML file (the CLI and tests; the workflow uses load_workflow_config)."""
    return load_workflow_config(path)
