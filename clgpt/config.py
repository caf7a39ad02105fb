"""config.yaml: validated against schemas/config.schema.yaml with defaults filled in, plus the checks a
schema cannot express (shapes that cannot work). Every error is one line naming the key and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml

from clgpt.errors import ClgptError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"
N_SPECIAL = 4  # <s> </s> <user> <assistant>


def load_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _fill_defaults(schema: dict, value):
    """Fill `default`s of object properties, recursively (a missing section becomes its defaults)."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    for key, sub in schema.get("properties", {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = _fill_defaults(sub, value[key])
    return value


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def validate_config(config: dict, source: str = "config.yaml") -> dict:
    """A copy of `config` with defaults filled in; ClgptError naming the key on any problem."""
    schema = load_schema()
    config = _fill_defaults(schema, copy.deepcopy(config if config is not None else {}))
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        if e.validator == "additionalProperties":
            allowed = sorted(e.schema.get("properties", {}))
            unknown = sorted(set(e.instance) - set(allowed))
            prefix = _where(e) + "." if e.absolute_path else ""
            raise ClgptError(
                f"{source}: unknown key '{prefix}{unknown[0]}'; allowed here: {', '.join(allowed)}"
            )
        raise ClgptError(f"{source}: {_where(e)}: {e.message}")
    check_shapes(config, source)
    return config


def check_shapes(config: dict, source: str = "config.yaml") -> None:
    """Model shapes that pass the schema but cannot work."""
    m, tok = config["model"], config["tokenizer"]
    if m["n_embd"] % m["n_head"]:
        raise ClgptError(
            f"{source}: model.n_embd={m['n_embd']} is not divisible by model.n_head={m['n_head']}; "
            "choose n_embd a multiple of n_head"
        )
    _check_model(m, source)
    if m["arch"] == "gpt2" and m["n_ctx"] % 256:
        raise ClgptError(
            f"{source}: model.n_ctx={m['n_ctx']} is not a multiple of 256; llama.cpp allocates positions "
            "in multiples of 256 and aborts past the table, so use 256, 512, ..."
        )
    if tok["vocab_size"] < 256 + N_SPECIAL:
        raise ClgptError(
            f"{source}: tokenizer.vocab_size={tok['vocab_size']} is below 260 (256 bytes + 4 special tokens)"
        )
    for stage in ("pretrain", "tune"):
        if config[stage]["ranks"] > config[stage]["batch_size"]:
            raise ClgptError(
                f"{source}: {stage}.ranks={config[stage]['ranks']} is more than {stage}.batch_size="
                f"{config[stage]['batch_size']}; every rank needs at least one row of each micro-batch"
            )
        if config[stage]["seq_len"] > m["n_ctx"]:
            raise ClgptError(
                f"{source}: {stage}.seq_len={config[stage]['seq_len']} is longer than model.n_ctx={m['n_ctx']}"
            )
    qtype = config["export"]["type"]
    if qtype in ("q8_0", "q4_0"):
        for key in ("n_embd", "n_ff"):
            if m[key] % 32:
                raise ClgptError(
                    f"{source}: model.{key}={m[key]} is not a multiple of 32, which export.type={qtype} "
                    "needs (rows are quantized in blocks of 32); use f32/f16 or change the shape"
                )


def _check_model(m: dict, source: str) -> None:
    """ModelConfig.validate: for llama an even head dim (RoPE pairs), n_head_kv dividing n_head, a
    consistent expert count; for gpt2 none of the llama-only keys."""
    from clgpt.model import ModelConfig

    try:
        ModelConfig.from_dict(m).validate()
    except ClgptError as e:
        raise ClgptError(f"{source}: {e}") from None


def load_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ClgptError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ClgptError(f"{path}: not valid YAML{where}; fix the syntax") from None
    if raw is not None and not isinstance(raw, dict):
        raise ClgptError(f"{path}: expected a mapping of sections (device, tokenizer, model, ...)")
    return validate_config(raw or {}, source=path)
