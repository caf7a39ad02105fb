"""The device tuners' records for one run, as the `tuning` setting gives them: the portable GEMM's tiles
(clgpt.device.tuner), portable flash attention's tiles and form (clgpt.device.tuner_flash, which weighs its kernels
against the batched form timed through clgpt.ops) and the row kernels' forms (clgpt.device.tuner_rows). The
training stages and `clgpt bench` take their knobs from here."""

from __future__ import annotations

from dataclasses import replace

import pyopencl as cl

from clgpt.device import tuner, tuner_flash, tuner_rows
from clgpt.device.builds import BuildsBeside
from clgpt.device.knobs import Knobs
from clgpt.device.tuning import launch_config
from clgpt.errors import ClgptError
from clgpt.ops import attention_ops, attention_seconds


def tuned_knobs(setting: str, dev, cfg, batch_size: int, seq_len: int, kn: Knobs, say=print,
                may_tune: bool = True) -> tuple[Knobs, list[str]]:
    """(`kn` with the records the `tuning` setting gives for this model and batch, the lines that say which, for
    the log). may_tune False (the ranks of a data-parallel stage): auto reads the cache only."""
    row = launch_config(dev.device, kn)
    beside = BuildsBeside(_untuned_builds(setting, dev, cfg, batch_size, seq_len, row, kn) if may_tune else [])
    try:
        record, line = tuner.resolve(setting, dev, cfg, batch_size, seq_len, row, say=say, may_tune=may_tune)
    finally:
        beside.join()
    weigh = replace(kn, gemm_tuning=record)  # the batched form on the tiles the run will take
    tiles, flash_line = tuner_flash.resolve(
        setting, dev, cfg, batch_size, seq_len, row, kn, say=say, may_tune=may_tune,
        time_batched=lambda: attention_seconds(dev, cfg, batch_size, seq_len, weigh))
    rows, rows_line = tuner_rows.resolve(setting, dev, cfg, batch_size, seq_len, row, kn, say=say, may_tune=may_tune)
    return replace(kn, gemm_tuning=record, flash_tuning=tiles, rows_tuning=rows), [line, flash_line, rows_line]


def _untuned_builds(setting: str, dev, cfg, batch_size: int, seq_len: int, row: dict, kn: Knobs) -> list:
    """The flash attention and row-kernel tuners' candidate builds where `tuning: auto` is about to tune them
    (wanted on this row and not in the cache), to run while the GEMM is tuned; [] otherwise (a cache that does not
    read is left to the tuners' own one-line errors)."""
    if (setting or "auto").strip() != "auto":
        return []
    path = tuner.cache_file(dev.device)
    try:
        records = tuner.read_file(path)["records"] if path.exists() else {}
    except ClgptError:  # resolve() says what is wrong with the file
        return []
    flash = tuner_flash.wanted(dev.device, row, seq_len, kn) and \
        tuner_flash.record_key(batch_size, cfg.n_head, seq_len, cfg.head_dim) not in records
    return candidate_builds(dev, cfg, batch_size, seq_len, kn, flash=flash,
                            batched=flash and not tuner_flash.scores_too_big(dev.device, cfg, batch_size, seq_len),
                            rows=tuner_rows.wanted(dev.device, row, kn)
                            and tuner_rows.record_key(cfg, batch_size, seq_len) not in records)


def candidate_builds(dev, cfg, batch_size: int, seq_len: int, kn: Knobs, flash: bool = True, batched: bool = False,
                     rows: bool = True, max_candidates: int | None = None) -> list:
    """The builds that need not wait for the GEMM's tiles, as callables: flash attention's candidates (the first
    max_candidates of each kernel), the programs the batched form's timing asks for first (its Ops, made and
    dropped) and the row kernels' candidates. A failure is left to the check or timing that meets it again."""
    def batched_programs():
        try:
            attention_ops(dev, cfg, batch_size, seq_len, kn)
        except (cl.Error, ClgptError):
            pass

    return ((tuner_flash.build_jobs(dev, cfg.n_head, cfg.head_dim, max_candidates) if flash else [])
            + ([batched_programs] if batched else []) + (tuner_rows.build_jobs(dev, cfg) if rows else []))
