"""Data parallelism over MPI: a stage with `ranks: N` runs as N processes (`mpiexec -n N`, or `srun` on a
cluster), each on its own OpenCL device, as llm.c does.

Every rank draws the whole micro-batch from the one sampler state (so the data order is the single-rank
run's) and keeps its rows [r*B//N, (r+1)*B//N). A rank's loss is a masked mean over its own rows, so it
back-propagates with scale m_r / M (its mask sum over the batch's) and the sum of the ranks' gradients is
the gradient of the whole batch's loss. Gradients are summed once per optimizer step (after all
accumulation micro-batches), before clipping and AdamW, by `Dist.allreduce_sum`: an all-to-all hands rank
r the r-th piece of every rank's gradient, rank r adds the pieces in rank order, and an all-gather hands
the sums back. The order of the additions is fixed by the code, not by the MPI library's algorithm, so
every rank holds the same bits and a run is bit-identical run to run. Each rank then takes the same AdamW
step on its own copy of the weights; rank 0 writes the checkpoints and the logs.

Failures: a Python error on any rank prints `error: <stage>: rank r of N (pid, host): ...`, is recorded in
the status folder `clgpt.training.launch` watches (CLGPT_RANK_DIR), and aborts every rank (MPI_Abort), so no rank
waits forever in a collective. A rank killed outright is reported by the launcher (`clgpt.training.launch`), which
maps the MPI library's message back to the rank through the same folder.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from contextlib import contextmanager

import numpy as np

from clgpt.device import knobs
from clgpt.errors import ClgptError

# Floats per bucket of the gradient all-reduce: the sum runs in pieces of this size, each an all-to-all
# plus an all-gather of BUCKET / ranks floats per rank. Host-memory MPI moves ~4 MB messages about 3x
# faster than 100+ MB ones on an H200 host; bench/bench_mpi.py measures the choice.
BUCKET = 1 << 20
SHM_BUCKET = 1 << 22  # the shared-memory sum's: 16 MB buckets beat 4 MB ones there (3 barriers a bucket)
MIN_SLICE = 1 << 16  # floats: the smallest slice a host thread of the shared-memory sum takes
RANK_DIR_ENV = "CLGPT_RANK_DIR"


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    u = a.view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def _f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


class Dist:
    """This process's place among the stage's ranks; a single rank (size 1, no MPI) does nothing."""

    def __init__(self, comm=None, stage: str = "stage"):
        self.comm, self.stage = comm, stage
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.local_rank, self.node, self.via, self.threads = 0, None, "mpi", 1
        if comm is not None:
            from mpi4py import MPI

            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this host
            self.local_rank = self.node.Get_rank()
            # sum through shared memory when every rank is on this host (CLGPT_REDUCE=mpi: MPI messages anyway);
            # the same bits either way, shared memory is ~25% faster on the H200 host (bench/RESULTS_GPU.md)
            one_host = all(comm.allgather(self.node.Get_size() == self.size))
            kn = knobs.read()
            self.via = "shm" if kn.reduce == "shm" and one_host else "mpi"
            # host threads for the shared-memory sums (CLGPT_REDUCE_THREADS); one measured fastest on the H200
            # host: the copies are bound by memory bandwidth, not by one core
            self.threads = kn.reduce_threads
        self.root = self.rank == 0
        self.where = f"rank {self.rank} of {self.size} (pid {os.getpid()} on {socket.gethostname()})"

    @classmethod
    def for_stage(cls, stage: str, ranks: int) -> "Dist":
        """ranks == 1: a single rank without MPI. ranks > 1: this process must be one of `ranks` MPI
        processes; anything else is a one-line error saying how to launch it."""
        if ranks <= 1:
            return cls(None, stage)
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ClgptError(f"{stage}.ranks={ranks} needs mpi4py and an MPI (pip install mpi4py mpich): {e}") from e
        size = MPI.COMM_WORLD.Get_size()
        if size != ranks:
            raise ClgptError(
                f"{stage}.ranks={ranks} but this process is one of {size} MPI rank(s); launch it as "
                f"`mpiexec -n {ranks} ...` (the Snakefile's rule does), or set {stage}.ranks: {size}"
            )
        return cls(MPI.COMM_WORLD, stage)

    # ---- rows and devices ----
    def rows(self, n: int) -> slice:
        """This rank's share of a micro-batch of n rows."""
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def device(self, device, devices: list | None):
        """This rank's OpenCL device: `devices[local_rank % len]` when a list is given, else the
        local_rank-th of the devices `device` matches (ranks share devices when there are fewer)."""
        from clgpt.device.opencl import get_device, get_device_for, matching_devices

        if device is not None and not isinstance(device, str):
            return device  # a clgpt.device.opencl.Device: every rank on it (tests)
        if devices:
            return get_device(str(devices[self.local_rank % len(devices)]))
        if self.size == 1:
            return get_device(device or None)
        found = matching_devices(device or None)
        return get_device_for(found[self.local_rank % len(found)])

    # ---- collectives ----
    def allgather(self, obj) -> list:
        return [obj] if self.comm is None else self.comm.allgather(obj)

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def allreduce_sum(self, a: np.ndarray, bucket: int | None = None, wire: str = "fp32",
                      out: np.ndarray | None = None) -> np.ndarray:
        """Sum of every rank's float32 vector `a` (same length everywhere), added in rank order; every rank
        gets the same bits, whatever the bucket size. wire="bf16" sends bfloat16 (half the bytes), adds in
        float32 and hands back the bf16-rounded sums. Writes into `out` when given."""
        if self.comm is None:
            if out is not None:
                np.copyto(out, a)
                return out
            return a
        if self.via == "shm" and wire == "fp32":
            return self._allreduce_shm(a, bucket or SHM_BUCKET, out)
        bucket = bucket or BUCKET
        from mpi4py import MPI

        R, n = self.size, a.size
        a = np.ascontiguousarray(a, dtype=np.float32)
        out = np.empty_like(a) if out is None else out
        mpi_t = MPI.FLOAT if wire == "fp32" else MPI.UINT16_T
        for s in range(0, n, bucket):
            chunk = a[s: s + bucket]
            m = chunk.size
            counts = [(j + 1) * m // R - j * m // R for j in range(R)]
            displs = [j * m // R for j in range(R)]
            mine = counts[self.rank]
            send = chunk if wire == "fp32" else _bf16(chunk)
            recv = self._scratch(R * mine, send.dtype)
            self.comm.Alltoallv([send, (counts, displs), mpi_t],
                                [recv, ([mine] * R, [i * mine for i in range(R)]), mpi_t])
            parts = recv.reshape(R, mine) if wire == "fp32" else _f32(recv).reshape(R, mine)
            piece = out[s + displs[self.rank]: s + displs[self.rank] + mine]
            np.copyto(piece, parts[0])
            for i in range(1, R):  # rank order: the same association on every rank and every run
                piece += parts[i]
            if wire == "fp32":
                self.comm.Allgatherv(MPI.IN_PLACE, [out[s: s + m], (counts, displs), MPI.FLOAT])
            else:
                gathered = np.empty(m, np.uint16)
                self.comm.Allgatherv(_bf16(piece), [gathered, (counts, displs), MPI.UINT16_T])
                out[s: s + m] = _f32(gathered)
        return out

    def _allreduce_shm(self, a: np.ndarray, bucket: int, out: np.ndarray | None) -> np.ndarray:
        """allreduce_sum through one shared-memory window per rank (all ranks on one host): rank r copies
        its bucket into its window, adds piece r of every window in rank order into its own window, and
        every rank copies the pieces out: one copy in, one out, no MPI messages but barriers. The same
        additions in the same order as the MPI path, so the same bits."""
        from mpi4py import MPI

        R, n = self.size, a.size
        a = np.ascontiguousarray(a, dtype=np.float32)
        out = np.empty_like(a) if out is None else out
        need = min(n, bucket)
        if getattr(self, "_win_size", 0) < need:  # collective: every rank makes the same calls in the same order
            if getattr(self, "_win", None) is not None:
                self._win.Free()
            self._win = MPI.Win.Allocate_shared(need * 4, 4, comm=self.node)
            self._win_size = need
            self._slots = []
            for r in range(R):
                buf, _ = self._win.Shared_query(r)
                self._slots.append(np.frombuffer(buf, np.float32, count=need))
        mine, par = self._slots[self.rank], self._parallel
        for s in range(0, n, bucket):
            m = min(bucket, n - s)
            lo, hi = self.rank * m // R, (self.rank + 1) * m // R
            self.node.Barrier()  # the others are done reading my window (last bucket, last call)
            par(lambda i, j: np.copyto(mine[i:j], a[s + i: s + j]), 0, m)
            self.node.Barrier()  # every window holds its rank's bucket
            if hi > lo:
                def add(i, j):
                    acc = out[s + i: s + j]
                    np.add(self._slots[0][i:j], self._slots[1][i:j], out=acc)
                    for r in range(2, R):  # rank order, as the MPI path adds
                        acc += self._slots[r][i:j]
                    mine[i:j] = acc  # piece r's sum, where the others read it
                par(add, lo, hi)
            self.node.Barrier()  # every piece is summed
            for r in range(R):
                if r != self.rank:
                    rl, rh = r * m // R, (r + 1) * m // R
                    par(lambda i, j: np.copyto(out[s + i: s + j], self._slots[r][i:j]), rl, rh)
        return out

    def _parallel(self, fn, lo: int, hi: int) -> None:
        """fn(i, j) over [lo, hi) in slices on `threads` threads (numpy releases the GIL in copies and adds;
        one thread moves host memory at a few GB/s, a host's cores together several times that). The
        slices are elementwise, so the bits do not depend on the thread count."""
        k = min(self.threads, (hi - lo) // MIN_SLICE)
        if k <= 1:
            fn(lo, hi)
            return
        if getattr(self, "_pool", None) is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="reduce")
        cuts = [lo + (hi - lo) * t // k for t in range(k + 1)]
        for f in [self._pool.submit(fn, cuts[t], cuts[t + 1]) for t in range(k)]:
            f.result()

    def _scratch(self, n: int, dtype) -> np.ndarray:
        """A receive buffer reused from call to call (fresh pages cost page faults at every step)."""
        key = np.dtype(dtype).str
        buf = getattr(self, "_bufs", {}).get(key)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1), dtype)
            self.__dict__.setdefault("_bufs", {})[key] = buf
        return buf[:n]

    def overlapped(self, eng) -> "OverlappedReduce | None":
        """The gradient reducer of `eng` that overlaps the backward pass (kept from step to step), or None
        when that cannot work: one rank, an engine without grad_hook, or an MPI without threads."""
        if self.comm is None or not hasattr(eng, "read_grads_async"):
            return None
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            return None
        cache = self.__dict__.setdefault("_overlap", {})
        if id(eng) not in cache:
            cache.clear()
            cache[id(eng)] = OverlappedReduce(self, eng)
        return cache[id(eng)]

    # ---- reporting ----
    def describe(self, device_name: str) -> str:
        """One line naming every rank (pid, host, device), gathered on all ranks; also written to the
        launcher's status folder so a rank killed later can be named by its pid."""
        me = self._me(device=device_name)
        self._status(me)
        table = self.allgather(me)
        return "; ".join(f"rank {t['rank']} pid {t['pid']} on {t['host']} ({t['device']})" for t in table)

    def _me(self, **extra) -> dict:
        """This rank's record: rank, world size, pid and host, with `extra`."""
        return {"rank": self.rank, "size": self.size, "pid": os.getpid(), "host": socket.gethostname(), **extra}

    def _status(self, record: dict) -> None:
        folder = os.environ.get(RANK_DIR_ENV)
        if not folder:
            return
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{self.rank}.json")
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # the status folder only improves the message; never fail a rank over it

    @contextmanager
    def guard(self):
        """With several ranks, an exception on this rank is printed with its rank and aborts every rank:
        the others may be waiting for it in a collective. Ctrl-C passes through (all ranks get it)."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            if self.comm is None:
                raise
            msg = str(e) if isinstance(e, ClgptError) else f"{type(e).__name__}: {e}"
            print(f"error: {self.stage}: {self.where}: {msg}", file=sys.stderr, flush=True)
            self._status(self._me(error=msg))
            if not isinstance(e, ClgptError):
                import traceback

                traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            self.comm.Abort(1)
        else:
            if self.comm is not None:  # a rank that ends now is not the one that failed (clgpt.training.launch)
                self._status(self._me(finished=True))


class OverlappedReduce:
    """Sums the gradients while the backward pass still runs, a layer at a time, as DDP's buckets do.

    begin() sets the engine's grad_hook: when backward has enqueued layer i's gradient kernels, the hook
    enqueues copies of blk.i.*'s gradients into page-locked host memory behind them (ParamStore.pinned,
    read_grads_async) and hands them to a worker thread, which waits for the copies and all-reduces them
    (Dist.allreduce_sum; MPI and numpy release the GIL) while the device goes on with layer i-1. end() adds
    what is left (embeddings, final norm), waits for the worker and writes the sums back in one copy from
    page-locked memory. The vectors are the store's padded layout (n_flat floats; the padding is zero on
    every rank, so its sum is too). Each element is still summed in rank order: the same bits as
    Dist.allreduce_sum over get_grads_flat()."""

    def __init__(self, dist: Dist, eng):
        self.dist, self.eng, store = dist, eng, eng.store
        self.host = store.pinned(store.n_flat)  # the local gradients as they arrive
        self.summed = store.pinned(store.n_flat)  # their sums over the ranks
        self.order = list(store.order)
        self.layers: dict[int, list[str]] = {}
        for name in self.order:
            if name.startswith("blk."):
                self.layers.setdefault(int(name.split(".")[1]), []).append(name)
        self.thread = None

    def begin(self) -> None:
        import queue
        import threading

        self.sent: set[str] = set()
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name="grad-allreduce", daemon=True)
        self.thread.start()
        self.eng.grad_hook = self._layer_done

    def _send(self, names) -> None:
        names = [n for n in names if n not in self.sent]
        if names:
            self.sent.update(names)
            self.jobs.put((self.eng.read_grads_async(names, self.host), self.eng.store.padded_spans(names)))

    def _layer_done(self, i: int) -> None:
        self._send(self.layers.get(i, []))

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.error is not None:
                continue
            try:
                event, spans = job
                event.wait()
                for a, b in spans:
                    self.dist.allreduce_sum(self.host[a:b], out=self.summed[a:b])
            except BaseException as e:  # noqa: BLE001 - re-raised by end() in the main thread
                self.error = e

    def end(self) -> None:
        """After backward: reduce the rest, wait for the worker, put the sums into the engine."""
        self.eng.grad_hook = None
        self._send(self.order)
        self.jobs.put(None)
        self.thread.join()
        self.thread = None
        if self.error is not None:
            raise self.error
        self.eng.store.write_grads(self.summed)
