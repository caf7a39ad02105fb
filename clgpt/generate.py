"""Sampling on the OpenCL forward pass: greedy, temperature, top-k, top-p, seeded.

The Generator runs the engine for cfg.arch (`clgpt.engine.make_engine`: GPT2Engine for gpt2,
LlamaEngine for llama; batch 1, seq_len = n_ctx) on any parameters -- typically the
float32 weights `gguf_io.read_gguf` reads back, so q8_0/q4_0 exports generate from the same dequantized
weights llama.cpp runs. Each step recomputes the whole prefix (no KV cache): models here are small and
the context is at most n_ctx positions. The prefix is padded up to a multiple of PAD_TO tokens: the
attention is causal, so padding after the last token changes none of its logits, and the engine sees
n_ctx / PAD_TO distinct lengths instead of n_ctx (on PoCL each new length costs a kernel build).

Context: a sequence never grows past n_ctx tokens (prompt + generated), the rows of position_embd;
llama.cpp stops at the same point (it aborts, rather than stops, past the table). A llama model has no
position table; the Generator still stops at n_ctx, the context it was trained for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from clgpt.errors import ClgptError
from clgpt.model import ModelConfig

PAD_TO = 32  # forward lengths are rounded up to a multiple of this (capped at n_ctx)


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 softmax of (V,) logits; -inf entries get probability 0."""
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max())
    return z / z.sum()


def sampling_probs(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, suppress_ids: Iterable[int] = ()
) -> np.ndarray:
    """(V,) float64 distribution after suppression, temperature, top-k then top-p (nucleus: the fewest
    most-likely tokens whose probability sums to >= top_p), renormalised."""
    z = np.array(logits, dtype=np.float64)
    for i in suppress_ids:
        z[i] = -np.inf
    if not np.isfinite(z).any():
        raise ClgptError("every token is suppressed; nothing left to sample")
    z = z / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z[z < kth] = -np.inf
    p = softmax(z)
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # first index where cum >= top_p, inclusive
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


class Generator:
    """Next-token logits and sampling from the OpenCL engine for one sequence at a time."""

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray], device=None):
        from clgpt.engine import make_engine  # import here: reading a GGUF must not need OpenCL

        self.cfg = cfg
        self.engine = make_engine(cfg, params, batch_size=1, seq_len=cfg.n_ctx, device=device)

    def next_logits(self, ids: Sequence[int]) -> np.ndarray:
        """(V,) float32 logits for the token after `ids` (only the last n_ctx ids are seen)."""
        ids = list(ids)[-self.cfg.n_ctx :]
        if not ids:
            raise ClgptError("cannot predict from an empty prompt; start it with the BOS token")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise ClgptError(f"token id {bad[0]} is not in the vocabulary (0..{self.cfg.vocab_size - 1})")
        T = min(-(-len(ids) // PAD_TO) * PAD_TO, self.cfg.n_ctx)
        tokens = np.zeros((1, T), dtype=np.int32)  # (1, T'), padded with id 0 after the prefix
        tokens[0, : len(ids)] = ids
        logits = self.engine.forward(tokens)  # (1, T', V)
        return np.array(logits[0, len(ids) - 1], dtype=np.float32)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int = 64,
        greedy: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: Iterable[int] = (),
        suppress_ids: Iterable[int] = (),
    ) -> list[tuple[int, float]]:
        """(token id, its probability under the distribution it was drawn from) for each new token.

        Stops at a stop id (not returned), after `max_tokens`, or when prompt + output fills n_ctx.
        Greedy takes the argmax (temperature 0 means greedy too); its probability is the plain softmax
        after suppression. Sampling is deterministic in `seed`.
        """
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_tokens < 0:
            raise ClgptError(
                f"sampling settings out of range: temperature={temperature} (>= 0), top_p={top_p} (0 < p <= 1), "
                f"top_k={top_k} (>= 0), max_tokens={max_tokens} (>= 0)"
            )
        greedy = greedy or temperature == 0
        stop = set(stop_ids)
        suppress = list(suppress_ids)
        rng = np.random.default_rng(seed)
        ids = list(prompt_ids)
        out: list[tuple[int, float]] = []
        while len(out) < max_tokens and len(ids) < self.cfg.n_ctx:
            logits = self.next_logits(ids)
            if greedy:
                p = sampling_probs(logits, suppress_ids=suppress)
                token = int(np.argmax(p))
            else:
                p = sampling_probs(logits, temperature, top_k, top_p, suppress)
                token = int(min(np.searchsorted(np.cumsum(p), rng.random(), side="right"), p.size - 1))
                while p[token] == 0.0:  # cumsum rounding at the top edge: step back to a live token
                    token -= 1
            if token in stop:
                break
            out.append((token, float(p[token])))
            ids.append(token)
        return out
