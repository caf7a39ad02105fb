"""Helpers of the engine tests (tests/test_engine_contract.py and the per-architecture modules): parameters with
noise, a random batch, and the largest relative difference between two sets of tensors."""

from __future__ import annotations

import numpy as np

from clgpt.model import init_params


def noisy_params(cfg, seed=0, std=0.2):
    """init_params plus noise, so the norms' weights and the biases matter for the gradients."""
    rng = np.random.default_rng(seed + 100)
    return {k: (v + rng.normal(0, std, v.shape)).astype(np.float32) for k, v in init_params(cfg, seed).items()}


def batch(cfg, B, T, seed=0):
    """(tokens, targets, mask) of B rows of T, about 30% of the positions masked out (never the first row's last)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    mask = (rng.random((B, T)) > 0.3).astype(np.float32)
    mask[0, -1] = 1
    return tokens, targets, mask


def max_rel(got: dict, want: dict) -> tuple[float, str]:
    """(the largest |got - want| relative to want's largest value, over the tensors of want; that tensor's name)."""
    worst, where = 0.0, ""
    for k in want:
        d = np.abs(np.asarray(got[k], np.float64) - want[k]).max() / (np.abs(want[k]).max() + 1e-8)
        if d > worst:
            worst, where = d, k
    return worst, where


def assert_two_runs_match_reference(runs, want_loss: float, want_g: dict):
    """runs: two (loss, grads) of one engine on one batch. The first matches the float64 reference's loss and
    gradients; the second is bit for bit the first."""
    assert abs(runs[0][0] - want_loss) < 1e-5 * max(1.0, abs(want_loss))
    worst, where = max_rel(runs[0][1], want_g)
    assert worst < 1e-4, f"grads: {worst:.3e} in {where}"
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        assert np.array_equal(runs[0][1][k], runs[1][1][k]), f"{k} differs between two identical runs"
