"""Snakemake's logger plugin `clgpt` (`--logger clgpt`, named by the workflow's profiles/default): clgpt's one
line for the command-line mistakes Snakemake refuses while it parses its arguments, before the Snakefile runs
(`--configfile missing.yaml`, `--config pretrain.steps=100`), in place of Snakemake's traceback.

Snakemake's own terminal output stays as it is: this handler writes nothing itself. It adds a filter to
Snakemake's logger (which runs before every handler, Snakemake's terminal one too) that turns such an error
record into clgpt's line. Snakemake imports every installed logger plugin when it starts, for any workflow:
this module imports nothing of clgpt until a record needs it."""

from __future__ import annotations

import logging
import sys

from snakemake_interface_logger_plugins.base import LogHandlerBase


class ArgumentErrors(logging.Filter):
    """An error record while Snakemake reads its arguments (a missing --configfile, a dotted --config key):
    clgpt's one line instead, naming the argument and what to do (clgpt.runner.refused_by_snakemake)."""

    def __init__(self, argv: list[str]):
        super().__init__()
        self.argv = argv
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not getattr(record, "exception", None):
            return True
        from clgpt.runner import refused_by_snakemake

        line = refused_by_snakemake(self.argv)
        if line is None:
            return True
        if self.said:  # one line, whatever Snakemake logs after it
            return False
        self.said = True
        record.msg, record.args = f"error: {line}", ()
        return True


class LogHandler(LogHandlerBase):
    def __post_init__(self) -> None:
        from snakemake.logging import logger

        self.logger = logger
        self.argument_errors = ArgumentErrors(sys.argv[1:])
        logger.addFilter(self.argument_errors)

    def close(self) -> None:
        self.logger.removeFilter(self.argument_errors)
        super().close()

    def emit(self, record: logging.LogRecord) -> None:
        pass  # Snakemake's terminal handler writes; see the module's text

    @property
    def writes_to_stream(self) -> bool:
        return False

    @property
    def writes_to_file(self) -> bool:
        return False

    @property
    def has_filter(self) -> bool:
        return True

    @property
    def has_formatter(self) -> bool:
        return True

    @property
    def needs_rulegraph(self) -> bool:
        return False
