"""The signals that ask a stage to save and stop: Ctrl-C (SIGINT), SIGTERM (`kill PID`, a cluster's time limit)
and SIGHUP (the terminal closed). All three end a stage the same way: a training loop finishes its step, saves
its checkpoint and stops; the stage prints one line and exits with 128 + the signal's number, as a shell does.

A signal whose disposition is SIG_IGN when a process starts stays ignored for SIGHUP: `nohup` sets that, and
a run started with it is meant to outlive its terminal. SIGINT and SIGTERM are always taken: a run started in
the background inherits SIGINT ignored, and its stage still stops on the watchdog's SIGINT (clgpt.stage)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
_NAMES = {signal.SIGINT: "Ctrl-C"}


class Stopped(KeyboardInterrupt):
    """Raised where a stop signal interrupts: a KeyboardInterrupt (every `except KeyboardInterrupt` saves and
    stops alike) that knows which signal it was."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum


def signal_name(signum: int) -> str:
    """Ctrl-C for SIGINT, else the signal's name (SIGTERM, SIGHUP)."""
    return _NAMES.get(signum) or signal.Signals(signum).name


def signum_of(e: BaseException) -> int:
    """The signal a KeyboardInterrupt stands for (a plain one is Ctrl-C)."""
    return getattr(e, "signum", signal.SIGINT)


def exit_code(signum: int) -> int:
    """A shell's exit status for a process stopped by `signum`: 130 for Ctrl-C, 143 SIGTERM, 129 SIGHUP."""
    return 128 + int(signum)


def raise_stopped(signum: int, frame) -> None:
    """A signal handler: raises Stopped(signum) where the main thread is (as Python's own for SIGINT)."""
    raise Stopped(signum)


def _taken(signum: int) -> bool:
    return signum != getattr(signal, "SIGHUP", None) or signal.getsignal(signum) is not signal.SIG_IGN


def install(handler: Callable) -> dict[int, object]:
    """Sets `handler` for every stop signal this process takes (see the module's text); the previous
    handlers, to give back to restore(). Nothing outside the main thread, where Python delivers signals."""
    return install_for(handler, STOP_SIGNALS)


def install_for(handler: Callable, which) -> dict[int, object]:
    """install() for the stop signals in `which` only."""
    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for signum in which:
        if _taken(signum):
            previous[signum] = signal.signal(signum, handler)
    return previous


def restore(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def stop_raises():
    """Within: each stop signal raises Stopped (SIGTERM and SIGHUP as Ctrl-C does), so a stage that is not
    in its training loop still ends with its one line."""
    previous = install(raise_stopped)
    try:
        yield
    finally:
        restore(previous)
