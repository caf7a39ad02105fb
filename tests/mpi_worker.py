"""One rank of the MPI tests (tests/test_mpi.py runs it as `mpiexec -n N python tests/mpi_worker.py SPEC`).

SPEC is JSON: {"mode": "grads", ...}: one step's gradients with N ranks (clgpt.training.train.accumulate_grads,
reduced during backward and after it) and, on rank 0, with one rank on the same batch; saved to
spec["out"] (.npz).
{"mode": "stage", "args": {...run_stage keywords...}, "kill": [rank, step(, signal)]}: run_stage; the given
rank sends itself SIGKILL (a rank that dies), or the signal given, after that optimizer step. Rank 0 writes the returned dict
to spec["out"] (.json)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from clgpt.stage import run_script  # noqa: E402
from clgpt.training.dist import Dist  # noqa: E402
from clgpt.training.train import run_stage  # noqa: E402
from clgpt.device.knobs import read as read_knobs


def grads(spec: dict) -> None:
    from clgpt.model import ModelConfig, init_params
    from clgpt.models.factory import make_engine
    from clgpt.training.train import accumulate_grads, stage_settings, _pretrain_inputs, _tune_inputs

    stage = spec["stage"]
    s = stage_settings(stage, spec["settings"])
    dist = Dist.for_stage(stage, s["ranks"])

    def inputs():
        if stage == "pretrain":
            return _pretrain_inputs(spec["encoded"], s, spec["model"], None)
        return _tune_inputs(spec["encoded"], s, spec["init_ckpt"], spec.get("mix_encoded"))

    inp = inputs()
    eng = make_engine(inp.cfg, inp.params, batch_size=-(-s["batch_size"] // dist.size), seq_len=s["seq_len"], knobs=read_knobs())
    overlapped = dist.overlapped(eng) is not None  # the engine offers the grad hook: the reduce runs during backward
    loss, _, _ = accumulate_grads(eng, inp.batches, s["accum_steps"], dist)  # overlapped with backward
    g_ranks = eng.get_grads_flat()
    again = inputs()
    accumulate_grads(eng, again.batches, s["accum_steps"], dist, overlap=False)  # one reduce after backward
    g_plain = eng.get_grads_flat()
    everywhere = dist.allgather(g_ranks.tobytes())
    if dist.root:
        one = inputs()
        eng1 = make_engine(one.cfg, one.params, batch_size=s["batch_size"], seq_len=s["seq_len"], knobs=read_knobs())
        loss1, _, _ = accumulate_grads(eng1, one.batches, s["accum_steps"], Dist(None))
        np.savez(spec["out"], ranks=g_ranks, plain=g_plain, one=eng1.get_grads_flat(), loss=loss, loss1=loss1,
                 overlapped=overlapped,
                 same_on_all_ranks=all(b == everywhere[0] for b in everywhere))
    dist.barrier()


def stage(spec: dict) -> None:
    kill = spec.get("kill")
    dist_rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))

    def callback(step, loss):
        if kill and dist_rank == kill[0] and step == kill[1]:
            os.kill(os.getpid(), kill[2] if len(kill) > 2 else signal.SIGKILL)

    out = run_stage(**spec["args"], callback=callback)
    if dist_rank == 0:
        Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    run_script({"grads": grads, "stage": stage}[spec["mode"]], None, spec=spec)
