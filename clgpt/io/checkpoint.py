"""Checkpoints: one `.npz` file with the model's shape, its weights, the AdamW state, the data sampler's
state and stage facts, so a stage can resume exactly and later stages rebuild the model from the file.

Layout (every member is a `.npy` inside an uncompressed zip, readable with `np.load`):
  meta                 uint8 bytes of a JSON object: format, version, cfg, step, and the non-array parts
                       of opt_state, rng_state and extra (arrays are replaced by {"__array__": member})
  params/<gguf name>   float32 weights, in `param_shapes(cfg)` order
  opt/..., rng/..., extra/...   the arrays of those trees

The bytes depend only on the contents: zip entries carry a fixed 1980-01-01 date and a fixed order, so
the same training run writes the same file. Writes go to `path + ".tmp"` and are renamed into place, so
a killed process leaves either the previous file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import numpy as np

from clgpt.atomic import atomic_path, disk_full_line, is_disk_full
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig, param_shapes

FORMAT = "clgpt-checkpoint"
VERSION = 1
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest date zip can store; no clock in the bytes


def _split_arrays(tree: Any, prefix: str, arrays: dict[str, np.ndarray]) -> Any:
    """JSON-able copy of `tree` with every numpy array (or numpy scalar) moved into `arrays`."""
    if isinstance(tree, dict):
        for key in tree:
            if not isinstance(key, str) or "/" in key:
                raise ClgptError(f"checkpoint: key {key!r} under {prefix!r} must be a string without '/'")
        # sorted: the bytes must not depend on the order a dict was filled in
        return {key: _split_arrays(tree[key], f"{prefix}/{key}", arrays) for key in sorted(tree)}
    if isinstance(tree, (list, tuple)):
        return [_split_arrays(value, f"{prefix}/{i}", arrays) for i, value in enumerate(tree)]
    if isinstance(tree, np.ndarray):
        arrays[prefix] = tree
        return {"__array__": prefix}
    if isinstance(tree, np.generic):
        arrays[prefix] = np.asarray(tree)
        return {"__array__": prefix, "scalar": True}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise ClgptError(f"checkpoint: cannot store {type(tree).__name__} at {prefix!r}")


def _join_arrays(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(tree, dict):
        if "__array__" in tree:
            value = arrays[tree["__array__"]]
            return value[()] if tree.get("scalar") else value
        return {key: _join_arrays(value, arrays) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_join_arrays(value, arrays) for value in tree]
    return tree


def _write_member(zf: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    info = zipfile.ZipInfo(name + ".npy", date_time=_ZIP_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    with zf.open(info, "w", force_zip64=True) as f:
        np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)


def save_checkpoint(
    path: str,
    cfg: ModelConfig,
    params: dict[str, np.ndarray],
    opt_state: dict | None,
    step: int,
    rng_state: Any,
    extra: dict | None = None,
) -> None:
    """Write a checkpoint atomically (`path.tmp`, fsync, rename). Trees may nest dicts, lists, scalars
    and numpy arrays; dict keys must be strings without '/'."""
    shapes = param_shapes(cfg)
    missing = sorted(set(shapes) - set(params))
    if missing:
        raise ClgptError(f"{path}: cannot save a checkpoint without {', '.join(missing)}")
    arrays: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        w = np.asarray(params[name], dtype=np.float32)
        if w.shape != shape:
            raise ClgptError(f"{path}: {name} has shape {w.shape}, the model needs {shape}")
        arrays[f"params/{name}"] = w
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "cfg": json.loads(cfg.to_json()),
        "step": int(step),
        "opt_state": _split_arrays(opt_state, "opt", arrays),
        "rng_state": _split_arrays(rng_state, "rng", arrays),
        "extra": _split_arrays(extra or {}, "extra", arrays),
    }
    meta_bytes = json.dumps(meta, sort_keys=True, allow_nan=False).encode("utf-8")

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                _write_member(zf, "meta", np.frombuffer(meta_bytes, dtype=np.uint8))
                for name, array in arrays.items():
                    _write_member(zf, name, array)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        needed = len(meta_bytes) + sum(a.nbytes + 256 for a in arrays.values())  # + each member's zip headers
        if not is_disk_full(e, path, needed):
            raise
        raise ClgptError(disk_full_line(path, needed)) from None


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint: {"cfg": ModelConfig, "params", "opt_state", "step", "rng_state", "extra"}.
    Raises ClgptError naming the file when it is missing, truncated or not a clgpt checkpoint."""
    if not os.path.exists(path):
        raise ClgptError(f"{path}: checkpoint not found; run the stage that writes it first")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode("utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError("no clgpt checkpoint header")
        if meta.get("version") != VERSION:
            raise ValueError(f"format version {meta.get('version')}, this clgpt reads {VERSION}")
        cfg = ModelConfig.from_dict(meta["cfg"])
        cfg.validate(where=f"{path}: cfg")
        params = {}
        for name, shape in param_shapes(cfg).items():
            w = arrays[f"params/{name}"]
            if w.shape != shape or w.dtype != np.float32:
                raise ValueError(f"{name} is {w.dtype}{w.shape}, expected float32{shape}")
            params[name] = w
        return {
            "cfg": cfg,
            "params": params,
            "opt_state": _join_arrays(meta["opt_state"], arrays),
            "step": int(meta["step"]),
            "rng_state": _join_arrays(meta["rng_state"], arrays),
            "extra": _join_arrays(meta["extra"], arrays),
        }
    except ClgptError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        # deleting it is not enough: the workflow publishes the stage's own copy again (results/staging/)
        stage = os.path.basename(os.path.dirname(os.path.abspath(path)))
        redo = (f"run the stage again: snakemake --cores 1 --forcerun {stage} model.gguf" if stage in ("pretrain", "tune")
                else "write it again with the stage that made it")
        raise ClgptError(f"{path}: not a readable clgpt checkpoint ({type(e).__name__}: {e}); {redo}") from e
