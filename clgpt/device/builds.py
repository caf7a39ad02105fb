"""Kernel builds on a few host threads: the device tuners build dozens of candidate programs on a first run, and
pyopencl lets go of the interpreter while a driver compiles, so they build side by side; the flash attention and
row-kernel tuners' candidates also build while the GEMM's are timed (BuildsBeside), since they do not depend on the
GEMM's tiles and the timings leave the host's cores idle."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

BUILD_THREADS = 8


def _workers() -> int:
    return min(BUILD_THREADS, os.cpu_count() or 1)


def run_builds(jobs: list) -> None:
    """Run `jobs` (callables that build a program each, leaving a failure to the candidate's check) on a few
    threads, and wait for them."""
    if _workers() > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(_workers()) as pool:
            list(pool.map(lambda job: job(), jobs))
    else:
        for job in jobs:
            job()


class BuildsBeside:
    """`jobs` started on a few threads now; `join` waits for them. Call it before their programs are asked for
    elsewhere, so none is built twice. Two cores are left to the timings that run meanwhile (the host's waits on
    the device, which a busy host would lengthen): a host of fewer than four builds nothing beside, and the jobs'
    own tuners build them later."""

    def __init__(self, jobs: list):
        workers = min(BUILD_THREADS, (os.cpu_count() or 1) - 2)
        self.pool = ThreadPoolExecutor(workers) if jobs and workers >= 2 else None
        self.futures = [self.pool.submit(job) for job in jobs] if self.pool is not None else []

    def join(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
            for f in self.futures:
                f.result()  # an unexpected error (the jobs keep the expected ones to the checks) surfaces here
