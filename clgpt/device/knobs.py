"""Knobs: every CLGPT_* environment variable that tunes or selects behaviour, declared once.

Each is an experiment or test switch, not a setting (settings live in schemas/config.schema.yaml). `read()`
parses them when it is called, never at import, so a test's monkeypatch.setenv before building an engine
takes effect; callers read once per constructor or function, not per launch. Unset means the default; a
value read() cannot use is a one-line ClgptError naming the variable and what to set.

    variable=values (default)                 what it is for
    CLGPT_LAUNCH=cpu|nvidia|gpu (device)      take that clgpt.device.tuning row on any device (GPU paths on PoCL);
                                              cpu and gpu: no tensor cores (nothing NVIDIA-specific runs)
    CLGPT_MATMUL=key=value,... (tuning)       the matmul form and tiles, e.g. kernel=matmul,TSM=128,TSN=128,...
    CLGPT_MATMUL_KEEP_SMALL=0|1 (0)           1: keep the table's small and narrow tiles beside CLGPT_MATMUL's
    CLGPT_MMA=BM=..,BN=..,... (tuning)        the big tensor-core tiles (kernels/matmul_mma.cl)
    CLGPT_MMA_SMALL=BM=..,... (tuning)        the small tensor-core tiles
    CLGPT_BF16=BM=..,...|off (tuning)         the bf16 GEMM's big tiles (kernels/matmul_bf16.cl); off: matmul_mma.cl
    CLGPT_BF16_SMALL=BM=..,... (tuning)       the bf16 GEMM's small tiles
    CLGPT_WGMMA=BM=..,...|off (tuning)        the wide wgmma tiles, deep products only (matmul_wgmma.cl); off: no wgmma
    CLGPT_WGMMA_NARROW=BM=..,... (tuning)     the narrow wgmma tiles
    CLGPT_WGMMA_MID=BM=..,...|off (tuning)    the mid wgmma tiles, for products the narrow leave a part wave; off: none
    CLGPT_FLASH=FWD_MT=..,... (attention)     flash attention's tiles (clgpt/ops/attention.py FLASH_TILES)
    CLGPT_PRESET=0|1 (tuning)                 launch through cl.Kernels whose arguments were set once
    CLGPT_SUBGROUP=off|8|16|32|64 (device)    the GPU row kernels' reductions: off, the local-memory forms; a size,
                                              sub-groups of it (one the device offers); unset: the device's choice
    CLGPT_MMA_EMULATE=0|1 (0)                 1: the tensor-core path on any device, mma emulated (tests on PoCL)
    CLGPT_WGMMA_EMULATE=0|1 (0)               1: with CLGPT_MMA_EMULATE on a device that is not NVIDIA's, the large
                                              bf16 products on matmul_wgmma.cl, wgmma emulated (tests on PoCL)
    CLGPT_NV_VERBOSE=any (unset)              NVIDIA's compiler reports registers and spills in the build log
    CLGPT_SM90A_VERBOSE=any (unset)           ptxas prints registers, spills and wgmma warnings of sm_90a rebuilds
    CLGPT_BENCH_PROFILE=0|1 (0)               1: `clgpt bench` also profiles a few steps, per kernel
    CLGPT_REDUCE=shm|mpi (shm)                the one-host gradient all-reduce: shared memory, or MPI (any but shm)
    CLGPT_REDUCE_THREADS=integer (1)          host threads of the shared-memory sums (at least 1)

Three fields no variable sets, since they change which kernel computes a product; the code that wants them passes
Knobs(...) in (wgmma_min_mnk: bench/gpu_tc.py check and bench/gpu_engine_check.py: 0, every bf16 product on wgmma;
gemm_tuning, flash_tuning, rows_tuning: the training stages and `clgpt bench`, through the tuners' resolve):

    field=values (default)                    what it is for
    wgmma_min_mnk=integer (None: 2**30)       smaller products (M*N*K) stay on mma.sync; None: clgpt.device.tuning's
    gemm_tuning=record (None)                 clgpt.device.tuner's record: the portable GEMM's tiles per product
                                              (the stages' and bench's `tuning` setting resolves it)
    flash_tuning=tiles (None)                 clgpt.device.tuner_flash's: portable flash attention's tiles a kernel
                                              and the form `attention: auto` takes (flash | batched)
    rows_tuning=record (None)                 clgpt.device.tuner_rows's: the row kernels' work-group sizes and
                                              sub-group reductions (CLGPT_SUBGROUP, where set, wins)

The 0 | 1 switches read as the code always has: any value but empty or 0 is on. CLGPT_RANK_DIR
(clgpt.training.dist, clgpt.training.launch) is not a knob but how the launcher and its ranks find their status
folder, so it is read where it is used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from clgpt.errors import ClgptError

SUBGROUP_VAR = "CLGPT_SUBGROUP"  # named again where the device refuses its size (clgpt.device.capabilities)
OFF = "off"  # a tile knob's value that turns its GEMM off (CLGPT_BF16, CLGPT_WGMMA)
FLASH_KEYS = ("FWD_MT", "KS", "DQ_MT", "KQ", "QK", "FWD_NREG", "DQ_NREG", "DKV_NREG")  # clgpt/ops/attention.py FLASH_TILES


@dataclass(frozen=True)
class Knobs:
    # clgpt.device.tuning: the table row and its tiles (None: the table's)
    launch: str = ""  # "" (the device's row) | cpu | nvidia | gpu
    matmul: dict | None = None  # the matmul config: kernel, TSM.. or RM.. (clgpt.device.tuning)
    matmul_keep_small: bool = False
    mma: dict | None = None
    mma_small: dict | None = None
    bf16: dict | str | None = None  # tiles, or OFF
    bf16_small: dict | None = None
    wgmma: dict | str | None = None  # tiles, or OFF
    wgmma_narrow: dict | None = None
    wgmma_mid: dict | str | None = None  # tiles, or OFF
    flash: dict | None = None  # clgpt.ops.attention's FLASH_TILES, overridden
    preset: int | None = None  # 0 | 1 overrides the row's `preset`
    subgroup: int | None = None  # None: the device's choice (clgpt.device.capabilities); 0: local memory; n: size n
    # clgpt.device.precision, clgpt.ops: which GEMM path and how its copies are made
    mma_emulate: bool = False
    wgmma_emulate: bool = False
    wgmma_min_mnk: int | None = None  # None: clgpt.device.tuning.WGMMA_MIN_MNK; passed in, never read from a variable
    gemm_tuning: dict | None = None  # a clgpt.device.tuner record; passed in (the `tuning` setting), never a variable
    flash_tuning: dict | None = None  # portable flash attention's tiles (clgpt.device.tuner_flash); passed in likewise
    rows_tuning: dict | None = None  # the row kernels' forms (clgpt.device.tuner_rows); passed in likewise
    # diagnostics
    nv_verbose: bool = False
    sm90a_verbose: bool = False
    bench_profile: bool = False
    # clgpt.training.dist: the gradient all-reduce
    reduce: str = "shm"  # shm, or anything else: MPI messages
    reduce_threads: int = 1


def _on(value: str | None) -> bool:
    """A switch defaulting to off: any value but unset, empty or 0 is on."""
    return value not in (None, "", "0")


def _int(var: str, value: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ClgptError(f"{var}={value!r}: set it to {what}") from None


def _choice(var: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ClgptError(f"{var}={value!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    return value


def parse_tiles(var: str, spec: str) -> dict:
    """'key=value,...' -> dict: `kernel` a name, `lsize` as 1x4, every other value an integer."""
    out = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        try:
            if key == "lsize":
                out[key] = tuple(int(v) for v in value.split("x"))
            else:
                out[key] = value if key == "kernel" else int(value)
        except ValueError:
            raise ClgptError(f"{var}={spec!r}: {key!r} needs an integer; set key=value pairs such as "
                             "BM=128,BN=128,WM=2,WN=4") from None
    return out


def _tiles(env: Mapping[str, str], var: str, can_be_off: bool = False) -> dict | str | None:
    """A tile override: None when unset or empty; OFF where the knob turns its GEMM off (elsewhere `off` is
    ignored, as it always was)."""
    spec = env.get(var, "").strip()
    if spec == OFF:
        return OFF if can_be_off else None
    return parse_tiles(var, spec) if spec else None


def _flash(env: Mapping[str, str]) -> dict | None:
    tiles = _tiles(env, "CLGPT_FLASH")
    unknown = sorted(set(tiles or ()) - set(FLASH_KEYS))
    if unknown:
        raise ClgptError(f"CLGPT_FLASH: unknown {', '.join(unknown)}; set {', '.join(FLASH_KEYS)}")
    return tiles


def read(env: Mapping[str, str] | None = None) -> Knobs:
    """The knobs as `env` (default os.environ) sets them now."""
    env = os.environ if env is None else env
    launch = env.get("CLGPT_LAUNCH", "").strip().lower()
    if launch:
        _choice("CLGPT_LAUNCH", launch, ("cpu", "nvidia", "gpu"))
    matmul = env.get("CLGPT_MATMUL", "").strip()
    preset = env.get("CLGPT_PRESET", "")
    subgroup = env.get(SUBGROUP_VAR, "").strip().lower()
    return Knobs(
        launch=launch,
        matmul=parse_tiles("CLGPT_MATMUL", matmul) if matmul else None,
        matmul_keep_small=_on(env.get("CLGPT_MATMUL_KEEP_SMALL")),
        mma=_tiles(env, "CLGPT_MMA"),
        mma_small=_tiles(env, "CLGPT_MMA_SMALL"),
        bf16=_tiles(env, "CLGPT_BF16", can_be_off=True),
        bf16_small=_tiles(env, "CLGPT_BF16_SMALL"),
        wgmma=_tiles(env, "CLGPT_WGMMA", can_be_off=True),
        wgmma_narrow=_tiles(env, "CLGPT_WGMMA_NARROW"),
        wgmma_mid=_tiles(env, "CLGPT_WGMMA_MID", can_be_off=True),
        flash=_flash(env),
        preset=int(preset) if preset in ("0", "1") else None,
        subgroup=None if not subgroup else 0 if subgroup == OFF else _int(
            SUBGROUP_VAR, subgroup, "off or a sub-group size the device offers, e.g. 16"),
        mma_emulate=_on(env.get("CLGPT_MMA_EMULATE")),
        wgmma_emulate=_on(env.get("CLGPT_WGMMA_EMULATE")),
        nv_verbose=bool(env.get("CLGPT_NV_VERBOSE")),
        sm90a_verbose=bool(env.get("CLGPT_SM90A_VERBOSE")),
        bench_profile=_on(env.get("CLGPT_BENCH_PROFILE")),
        reduce=env.get("CLGPT_REDUCE", "shm"),
        reduce_threads=max(1, _int("CLGPT_REDUCE_THREADS", env.get("CLGPT_REDUCE_THREADS", "1"),
                                   "a number of threads, e.g. 1")),
    )
