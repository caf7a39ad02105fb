"""What every stage script shares, and what the workflow knows about each stage's code.

- `run_script`: stderr goes to the terminal and to the rule's log; a ClgptError, an OSError (a read-only
  folder, a full disk), a bug (its traceback in the log), Ctrl-C, SIGTERM or SIGHUP ends the stage with one
  line (exit 1, or 128 + the signal's number) instead of a traceback; and the stage stops (saving its checkpoint, like Ctrl-C) when the Snakemake that started it
  is gone (kill -9 leaves its jobs running otherwise).
- `one_line`: in the Snakemake process, a failed or stopped stage's own line is the last word: Snakemake's
  failed-job block is not shown after it.
- `forward_stops`: in the Snakemake process, SIGTERM or SIGHUP sent to Snakemake alone stops the running
  stages as if they got it (they save and say their line), instead of Snakemake waiting for them.
- `code_inputs`: the package modules a stage script imports, directly or through each other, and the
  kernels when it builds them: the rules list these as inputs, so editing any of them re-runs the stage.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

from clgpt import signals
from clgpt.errors import ClgptError
from clgpt.ranks import env_rank

PACKAGE = "clgpt"
WATCH_SECONDS = 1.0  # how often the watchdog looks for the Snakemake process


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self):
        return self.streams[0].isatty()


# ---- the parent watchdog ------------------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[list[str], int] | None:
    """(argv, parent pid) of a live process, from /proc; None when it is gone (or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    if fields[0] in ("Z", "X"):  # a zombie is gone too
        return None
    return argv, int(fields[1])


def _is_snakemake(argv: list[str]) -> bool:
    """`snakemake ...`, `python /path/bin/snakemake ...` or `python -m snakemake ...`."""
    head = argv[:3]
    return any(os.path.basename(a) == "snakemake" for a in head) or head[1:3] == ["-m", "snakemake"]


def snakemake_chain() -> list[tuple[int, int]]:
    """[(pid, its parent pid)] from this process's parent up to the nearest `snakemake` process; [] when
    no ancestor is Snakemake (a script run by hand or by a test)."""
    chain, pid = [], os.getppid()
    while pid > 1:
        stat = _proc_stat(pid)
        if stat is None:
            return []
        argv, ppid = stat
        chain.append((pid, ppid))
        if _is_snakemake(argv):
            return chain
        pid = ppid
    return []


def _watch(chain: list[tuple[int, int]], stop: threading.Event, on_gone: Callable[[int], None]) -> None:
    while not stop.wait(WATCH_SECONDS):
        for pid, ppid in chain:
            stat = _proc_stat(pid)
            if stat is None or stat[1] != ppid:  # gone, or its parent died and it was re-parented
                on_gone(chain[-1][0])
                return


# exit statuses of a stage that has said its one line: run_script's 1 for an error, 128 + a stop signal's number
SAID = {1} | {signals.exit_code(n) for n in signals.STOP_SIGNALS}
_STATUS = re.compile(r"non-zero exit status (-?\d+)|died with <Signals\.(\w+): (\d+)>")
# Snakemake's records that still show once a job failed: the other jobs' progress (with --keep-going, or
# jobs running beside the failed one)
_PROGRESS_EVENTS = {"job_info", "job_started", "job_finished", "progress", "shellcmd", "group_info"}


def _status_line(rule: str, status: int | None, log: str) -> str:
    """clgpt's line for a stage that ended without saying one (killed outright, a crash of Python itself)."""
    if status is None:
        how = "failed"
    elif status < 0 or status > 128:
        num = -status if status < 0 else status - 128
        try:
            how = f"was killed by {signal.Signals(num).name}"
        except ValueError:
            how = f"ended with exit status {status}"
    else:
        how = f"ended with exit status {status}"
    kill9 = " (out of memory, or `kill -9`)" if status in (-9, 137) else ""
    see = f"; its log: {log}" if log else ""
    return f"error: stage {rule} {how}{kill9}{see}; run the same command again to resume"


class OneLine(logging.Filter):
    """Snakemake's records after a stage failed: none on the terminal. The stage has said its one line
    (run_script); Snakemake's failed-job block (RuleException, the CalledProcessError with the whole shell
    line, "Error in rule", "Exiting because...", WorkflowError) would follow and bury it. A stage that ended
    without a line (killed with -9, a crashed interpreter) gets clgpt's line instead of that block."""

    def __init__(self, stream=None):
        super().__init__()
        self.failed = False  # a job failed: from now on, only progress records show
        self.status: int | None = None  # the exit status of the failed job, from its exception record
        self.stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        event = str(getattr(record, "event", "") or "")
        if record.levelno >= logging.ERROR:
            text = str(record.msg)
            m = _STATUS.search(text)
            if m:
                self.status = int(m.group(1)) if m.group(1) is not None else -int(m.group(3))
            if event == "job_error":
                if self.status not in SAID:
                    log = getattr(record, "log", None) or []
                    log = ", ".join(map(str, log)) if isinstance(log, (list, tuple)) else str(log)
                    rule = getattr(record, "rule_name", "?")
                    # on a line of its own: the stage may have died in the middle of its progress bar
                    print("\n" + _status_line(rule, self.status, log), file=self.stream or sys.stderr, flush=True)
                self.failed, self.status = True, None
                return False
            if m or "Exiting because a job execution failed" in text or "Cancelling snakemake" in text:
                self.failed = True
                return False
        if self.failed or _interrupted.is_set():
            return event in _PROGRESS_EVENTS
        return True


_interrupted = threading.Event()  # set in the Snakemake process once it got Ctrl-C


def one_line(logger: logging.Logger) -> None:
    """Call in the Snakemake process (the Snakefile): a failed or interrupted stage's one line is the last
    word on the terminal (OneLine). After Ctrl-C only Snakemake's progress shows: the stage saves its
    checkpoint and says so."""
    if not any(isinstance(f, OneLine) for f in logger.filters):
        logger.addFilter(OneLine())
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        return  # SIGINT ignored (a run started in the background): no Ctrl-C will come

    def on_ctrl_c(signum, frame):
        _interrupted.set()
        return previous(signum, frame)

    signal.signal(signal.SIGINT, on_ctrl_c)


_STAGE_SCRIPT = re.compile(r"(^|/)scripts/\w+\.py$")


def running_stages(root: int | None = None) -> list[int]:
    """The pids of the stage scripts (`python scripts/NAME.py ...`, each MPI rank one) among the descendants
    of process `root` (this one by default), from /proc; [] where there is none (or no /proc)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    argvs: dict[int, list[str]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc/self") else []):
        stat = _proc_stat(int(entry))
        if stat is not None:
            argvs[int(entry)] = stat[0]
            children.setdefault(stat[1], []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if any(_STAGE_SCRIPT.search(a) for a in argvs[pid][1:3]):
            found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def forward_stops(stream=None) -> None:
    """Call in the Snakemake process once its scheduler runs (the workflow's `onstart`, after Snakemake set
    its own SIGTERM handler): SIGTERM or SIGHUP sent to Snakemake alone (`kill PID`, a scheduler that
    signals only the process it started) reaches the running stages, which save and stop as on Ctrl-C
    and say their one line; then Snakemake ends as it does on SIGTERM, once its running jobs ended. Without
    this, SIGTERM makes Snakemake wait for a training stage to run all its steps, and SIGHUP kills it and
    leaves its lock. A SIGHUP ignored when Snakemake started (`nohup`) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    graceful = signal.getsignal(signal.SIGTERM)

    def on_stop(signum, frame):
        _interrupted.set()  # the stages speak; Snakemake's records of their failed jobs do not
        stages = running_stages()
        for pid in stages:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # it ended meanwhile
                pass
        if not stages:  # between two jobs: no stage to say it
            print(f"error: stopped by {signals.signal_name(signum)}; run snakemake again to resume",
                  file=stream or sys.stderr, flush=True)
        if callable(graceful):
            graceful(signal.SIGTERM, frame)

    signals.install_for(on_stop, [s for s in signals.STOP_SIGNALS if s != signal.SIGINT])


RESUME_AFTER_KILL = "run `snakemake --unlock`, then the same snakemake command with --rerun-incomplete to resume"
_lost_parent: list[int] = []  # the pid of the Snakemake that went away, once the watchdog saw it


def _stop_for_lost_parent(snakemake_pid: int) -> None:
    _lost_parent.append(snakemake_pid)
    os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the training loop saves its checkpoint and stops


def _locked_by(workdir: str | Path) -> list[int | None] | None:
    """When `workdir/.snakemake/locks` holds a lock: the other Snakemake processes that work in `workdir`
    (their pids; None for one whose folder cannot be read). None when there is no lock or no /proc."""
    workdir = Path(workdir).resolve()
    if not any((workdir / ".snakemake" / "locks").glob("*.lock")) or not os.path.isdir("/proc/self"):
        return None
    me = {os.getpid(), os.getppid()}
    found: list[int | None] = []
    for entry in sorted((e for e in os.listdir("/proc") if e.isdigit()), key=int):
        stat = _proc_stat(int(entry)) if int(entry) not in me else None
        if stat is None or not _is_snakemake(stat[0]):
            continue
        try:
            if Path(os.readlink(f"/proc/{entry}/cwd")).resolve() == workdir:
                found.append(int(entry))
        except OSError:
            found.append(None)
    return found


def stale_lock(workdir: str | Path = ".") -> bool:
    """Whether `workdir/.snakemake/locks` holds a lock that no running Snakemake owns (one killed with -9
    leaves it). False when that cannot be told (no /proc, a process we may not inspect): Snakemake's own
    lock check then speaks."""
    return _locked_by(workdir) == []


def live_run(workdir: str | Path = ".") -> int | None:
    """The pid of another Snakemake working in `workdir` while a lock is held there (a run in progress)."""
    return next((pid for pid in _locked_by(workdir) or [] if pid is not None), None)


ANOTHER_RUN = ("another snakemake (pid {pid}) is running in this folder; wait for it to end, or stop it with "
               "Ctrl-C in its terminal; leave its files alone (no --unlock, no --rerun-incomplete while it runs)")


# ---- running a stage script -----------------------------------------------------------------------

def run_script(main: Callable, log_path: str | None, **kwargs) -> None:
    log = None
    if log_path and env_rank() == 0:  # one log per stage: rank 0's (the others print to the terminal only)
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        log = open(log_path, "w", encoding="utf-8")
        sys.stderr = _Tee(sys.__stderr__, log)
    stop = threading.Event()
    chain = snakemake_chain()
    if chain:
        threading.Thread(target=_watch, args=(chain, stop, _stop_for_lost_parent), daemon=True).start()
    code = 0
    try:
        with signals.stop_raises():  # SIGTERM and SIGHUP stop a stage as Ctrl-C does
            main(**kwargs)
    except ClgptError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt as e:
        signum = signals.signum_of(e)
        if env_rank() != 0:
            pass  # every rank got the signal, or learned of it from the others: rank 0 speaks for the stage
        elif _lost_parent:
            print(f"\nerror: snakemake was killed; this stage stopped and kept its checkpoint; {RESUME_AFTER_KILL}",
                  file=sys.stderr)
        elif signum == signal.SIGINT:
            print("error: interrupted; run snakemake again to resume", file=sys.stderr)
        else:
            print(f"error: stopped by {signals.signal_name(signum)}; run snakemake again to resume", file=sys.stderr)
        code = signals.exit_code(signum)
    except OSError as e:
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        code = 1
    except Exception as e:  # a bug: its traceback goes to the log, one line to the terminal
        import traceback

        where = log_path if log else None
        (log or sys.stderr).write(traceback.format_exc())
        print(f"error: {type(e).__name__}: {e}; this is a bug in clgpt, please report it with "
              f"{where or 'the traceback above'}".replace("\n", " "), file=sys.__stderr__ if log else sys.stderr)
        if log:
            log.write(f"error: {type(e).__name__}: {e}\n")
        code = 1
    finally:
        stop.set()
        if log:
            sys.stderr = sys.__stderr__
            log.close()
    if code:
        sys.exit(code)


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the file, the reason and what to do."""
    from clgpt.atomic import disk_full_line, is_disk_full

    if is_disk_full(e):
        if e.filename is not None:
            return disk_full_line(e.filename)
        return "the disk is full; free some space on the disk that holds results/ and run the same command again"
    name = e.filename if e.filename is not None else "a file"
    what = e.strerror or str(e)
    if isinstance(e, PermissionError):
        return f"{name}: {what}; make the folder writable (chmod u+w) or choose another output path"
    if isinstance(e, FileNotFoundError):
        return f"{name}: {what}; check the path (the folder must exist)"
    return f"{name}: {what}"


# ---- the code a stage runs ---------------------------------------------------------------------------

def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _import_statements(body: list) -> list:
    """The import statements in a list of statements and in every block nested in them (function and class
    bodies, if/try/with/match blocks). Imports are statements, so expressions need no visit: this is
    ast.walk's answer at a fraction of its cost (the workflow scans every stage's graph at each parse)."""
    found = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for _, block in ast.iter_fields(node):
            if isinstance(block, list) and block and isinstance(block[0], (ast.stmt, ast.excepthandler,
                                                                            ast.match_case)):
                found += _import_statements(block)
    return found


# (file, module, mtime, size) -> its imports: the stages share most of their graph, so one parse per file
_IMPORTS: dict[tuple, frozenset] = {}


def _imports(path: Path, module: str) -> frozenset:
    """Package modules a file imports anywhere (also inside functions): `import clgpt.x`,
    `from clgpt.x import y`, `from clgpt import x` (x a module), `from .x import y`."""
    st = path.stat()
    key = (str(path), module, st.st_mtime_ns, st.st_size)
    if key not in _IMPORTS:
        _IMPORTS[key] = frozenset(_scan_imports(path, module))
    return _IMPORTS[key]


def _scan_imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name.split(".")[0] == PACKAGE:
                found.add(name)
                found |= {f"{name}.{a.name}" for a in node.names}  # `from clgpt import x`: x may be a module
    return found


def code_inputs(script: str | Path, root: str | Path = ".") -> list[str]:
    """The files a stage script runs, relative to `root` (the workflow folder): every package module in
    its import graph, each with its packages' `__init__.py`, plus `kernels/*.cl` when the graph holds
    clgpt/device/opencl.py (which builds them at run time)."""
    root = Path(root)
    seen: dict[str, Path] = {}
    todo = [(None, root / script)]
    while todo:
        module, path = todo.pop()
        names = _imports(path, module or "")
        for name in sorted(names):
            parts = name.split(".")
            for n in range(1, len(parts) + 1):  # importing clgpt.x runs clgpt/__init__.py first
                sub = ".".join(parts[:n])
                if sub in seen:
                    continue
                file = _module_file(root, sub)
                if file is not None:
                    seen[sub] = file
                    todo.append((sub, file))
    files = sorted(str(p.relative_to(root)) for p in seen.values())
    if f"{PACKAGE}.device" in seen:
        files += sorted(str(p.relative_to(root)) for p in (root / "kernels").glob("*.cl"))
    return files
