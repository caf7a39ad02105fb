"""Where the files that ship with clgpt live: `kernels/` and `schemas/` sit beside the package in a
checkout and inside it (as package data, see pyproject.toml) in an installed wheel."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def data_path(name: str) -> Path:
    """`clgpt/<name>` when installed from a wheel, else `<checkout>/<name>`."""
    inside = PACKAGE_DIR / name
    return inside if inside.exists() else PACKAGE_DIR.parent / name
