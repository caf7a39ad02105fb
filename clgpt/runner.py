"""`clgpt run KEY=VALUE ... [snakemake arguments]`: Snakemake with config overrides written as users write
them (`pretrain.steps=100`). Snakemake's own `--config` takes only top-level keys, and a nested one as a
whole mapping (`--config 'pretrain={steps: 100}'`); a dotted key is refused there with a traceback. This
turns every KEY=VALUE argument into that form (keys of one section merged into one mapping) and passes the
rest of the arguments on unchanged: `clgpt run pretrain.steps=100 tune.lr=1e-3 --cores 1 model.gguf`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from clgpt.errors import ClgptError

_OVERRIDE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)=(.*)", re.S)


def _flow(value) -> str:
    """A nested dict of override texts as one YAML flow mapping: {steps: "100", lr: "1e-3"}. Each value is
    quoted, so Snakemake's YAML 1.1 reading keeps it text (`1:0` is not the number 60, `yes` not true);
    clgpt's config loader then reads the text as config.yaml's values are read (YAML 1.2: "100" is 100)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def snakemake_args(args: list[str]) -> list[str]:
    """The arguments for `python -m snakemake`: each KEY=VALUE (KEY dotted or not) gathered into one
    `--config` with a flow mapping per section; every other argument, in order."""
    overrides: dict = {}
    rest = []
    configfiles = False  # after --configfile: its files (Snakemake takes every word up to the next option)
    for arg in args:
        m = _OVERRIDE.fullmatch(arg) if not arg.startswith("-") else None
        option, eq, value = arg.partition("=")
        if option in _CONFIGFILE:
            configfiles = True
            if eq:
                _check_configfile(option, value)
        elif arg.startswith("-"):
            configfiles = False
        elif configfiles and m is None:
            _check_configfile("--configfile", arg)
        if m is None:
            if not arg.startswith("-") and _is_key(arg):  # `pretrain.steps` without `=VALUE`: not a target
                raise ClgptError(f"{arg}: a config key without a value; write {arg}=VALUE")
            rest.append(arg)
            continue
        *sections, key = m.group(1).split(".")
        shown = arg if arg.isprintable() else repr(arg)  # a value with a newline still gives a one-line error
        _check_section(shown, (sections or [key])[0])
        where = overrides
        for i, section in enumerate(sections):
            where = where.setdefault(section, {})
            if not isinstance(where, dict):
                raise ClgptError(f"{shown}: {'.'.join(sections[: i + 1])} was given a value already; "
                                 "give either the section's keys or one value")
        if isinstance(where.get(key), dict):
            raise ClgptError(f"{shown}: {m.group(1)} is a section and has keys given already; give its keys")
        where[key] = m.group(2)
    if not overrides:
        return rest
    config = [f"{k}={_flow(v)}" for k, v in overrides.items()]
    return [*rest, "--config", *config]


_CONFIGFILE = ("--configfile", "--configfiles")


def _check_configfile(option: str, path: str) -> None:
    """A --configfile that is missing, a folder or not YAML: clgpt's one line naming it (and the line of a
    YAML mistake), before Snakemake reads it with a traceback."""
    from clgpt.config import read_yaml

    try:
        read_yaml(path)
    except ClgptError as e:
        raise ClgptError(f"{option} {e}") from None


# Snakemake's own test of a --config key (snakemake.cli.parse_config)
_SNAKEMAKE_KEY = re.compile(r"[a-zA-Z_][\w-]*\w$")
_CONFIG = ("--config", "-C")


def refused_by_snakemake(argv: list[str]) -> str | None:
    """clgpt's line for the first --configfile or --config argument of a plain `snakemake` command line that
    Snakemake refuses with a traceback while it parses its arguments, before the workflow runs (a missing or
    broken config file, a dotted or malformed --config key); None when there is none. Read in the Snakemake
    process by Snakemake's logger plugin `clgpt` (snakemake_logger_plugin_clgpt), which the workflow's
    profiles/default names."""
    option = None  # the option whose words follow (Snakemake takes every word up to the next option)
    for arg in argv:
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if arg.startswith("-") and arg != "-":  # argparse's test of an option ("-" alone is a value)
            option = name if name in _CONFIGFILE + _CONFIG else None
            if not (option and eq):
                continue
            arg = value
        try:
            if option in _CONFIGFILE:
                _check_configfile("--configfile", arg)
            elif option in _CONFIG:
                _check_snakemake_config(arg)
        except ClgptError as e:
            return str(e)
    return None


def _check_snakemake_config(entry: str) -> None:
    """One --config entry as Snakemake's parser takes it: KEY=VALUE, KEY a plain name."""
    shown = entry if entry.isprintable() else repr(entry)
    key, eq, value = entry.partition("=")
    if not eq:
        raise ClgptError(f"--config {shown}: give KEY=VALUE (a nested key as --config 'pretrain={{steps: 100}}', "
                         "or clgpt run pretrain.steps=100)")
    if _SNAKEMAKE_KEY.match(key):
        return
    m = _OVERRIDE.fullmatch(entry)
    if m and "." in key:
        *sections, last = key.split(".")
        nested = value
        for k in reversed([*sections[1:], last]):
            nested = f"{{{k}: {nested}}}"
        raise ClgptError(f"--config {shown}: Snakemake takes no dotted keys; use clgpt run {shown} (with the rest "
                         f"of the command) or --config '{sections[0]}={nested}'")
    raise ClgptError(f"--config {shown}: '{key}' is not a config key; the config's keys start with one of "
                     f"{', '.join(sorted(_schema_keys()))}")


def _schema_keys() -> list[str]:
    from clgpt.config import load_schema

    return sorted(load_schema()["properties"])


def _is_key(arg: str) -> bool:
    """Whether `arg` is a dotted config key (section.key, as the schema has it); model.gguf is a target."""
    from clgpt.config import load_schema

    node = load_schema()
    parts = arg.split(".")
    for part in parts:
        props = node.get("properties") if isinstance(node, dict) else None
        if not props or part not in props:
            return False
        node = props[part]
    return len(parts) > 1


def _check_section(arg: str, name: str) -> None:
    """A top-level key the config has (Snakemake would stop on some others with a traceback)."""
    import difflib

    from clgpt.config import load_schema

    allowed = sorted(load_schema()["properties"])
    if name not in allowed:
        near = difflib.get_close_matches(name, allowed, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ClgptError(f"{arg}: unknown key '{name}'; {hint}the config's keys start with one of {', '.join(allowed)}")


def run(args: list[str]) -> int:
    """Run Snakemake in the current folder with `args` (see the module's text); its exit code."""
    cmd = [sys.executable, "-m", "snakemake", *snakemake_args(args)]
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Snakemake got the same Ctrl-C and stops its jobs: wait for it
        return proc.wait()
