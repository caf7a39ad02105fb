"""Sampling on the OpenCL forward pass: greedy, temperature, top-k, top-p, seeded.

The Generator runs the engine for cfg.arch (`clgpt.models.factory.make_engine`: GPT2Engine for gpt2,
LlamaEngine for llama; batch 1, seq_len = n_ctx) on any parameters -- typically the
float32 weights `gguf_io.read_gguf` reads back, so q8_0/q4_0 exports generate from the same dequantized
weights llama.cpp runs. It prefills the prompt in one forward pass, then decodes one token a step against a
key/value cache (clgpt.inference.kvcache). The prompt is padded up to a multiple of PAD_TO tokens: the attention is
causal, so padding after the last token changes none of its logits, and the engine sees n_ctx / PAD_TO
distinct lengths instead of n_ctx (on PoCL each new length costs a kernel build).

Stopping: `eog_ids` is llama.cpp's end-of-generation set of a GGUF (EOS, EOT, EOM, the fill-in-the-middle
ends and the tokens llama.cpp knows by name, `</s>` and `<|im_end|>` among them); every client stops there.

Context: a sequence never grows past n_ctx tokens (prompt + generated), the rows of position_embd;
llama.cpp stops at the same point (it aborts, rather than stops, past the table). A llama model has no
position table; the Generator still stops at n_ctx, the context it was trained for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from clgpt.errors import ClgptError
from clgpt.model import ModelConfig
from clgpt.device.knobs import Knobs

PAD_TO = 32  # forward lengths are rounded up to a multiple of this (capped at n_ctx)

# llama.cpp's end-of-generation tokens by their text (llama-vocab.cpp, the vocabulary's load), besides the ids the
# GGUF names under tokenizer.ggml.*_token_id
EOG_NAMES = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
_EOG_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def eog_ids(kv: dict) -> frozenset[int]:
    """The end-of-generation token ids of a GGUF's key/values, as llama.cpp (llama_vocab_is_eog) has them:
    the EOS, EOT and EOM ids and the fill-in-the-middle ends it names, and every token whose text is in EOG_NAMES
    (except `</s>` beside `<|tool_response>` or `<|plamo:eos|>`, where it is ordinary text)."""
    tokens = kv.get("tokenizer.ggml.tokens") or []
    out = {kv[f"tokenizer.ggml.{k}_token_id"] for k in _EOG_KEYS if isinstance(kv.get(f"tokenizer.ggml.{k}_token_id"), int)}
    named = {t: i for i, t in enumerate(tokens) if t in EOG_NAMES or t == "<|plamo:eos|>"}
    out |= {i for t, i in named.items() if t in EOG_NAMES}
    text = {i: tokens[i] for i in out if 0 <= i < len(tokens)}
    has = set(text.values())
    if "<|end|>" in has and (("<|return|>" in has and has & {"<|call|>", "<|calls|>"}) or
                             (has & {"<|call|>", "<|calls|>"} and "<|flush|>" in has)):
        out.discard(named["<|end|>"])  # o200k_harmony, solar-open: <|end|> ends a message, not the generation
    if "</s>" in has and has & {"<|tool_response>", "<|plamo:eos|>"}:
        out.discard(named["</s>"])  # gemma4, plamo: </s> is ordinary text there
    return frozenset(i for i in out if 0 <= i < len(tokens) or not tokens)


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
    suppress = list(suppress_ids)
    if suppress:
        z[suppress] = -np.inf
    if not np.isfinite(z).any():
        raise ClgptError("every token is suppressed; nothing left to sample")
    z = z / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z[z < kth] = -np.inf
    p = softmax(z)
    if top_p < 1.0:
        # the tokens left after top-k, most likely first (ties by id); the zeros past them would sort last
        # and never change what is kept, so they are left out of the sort: the same order, over fewer tokens
        live = np.flatnonzero(p)
        order = live[np.argsort(-p[live], kind="stable")]
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # first index where cum >= top_p, inclusive
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


class Generator:
    """Next-token logits and sampling from the OpenCL engine for one sequence at a time."""

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray], device=None, *, knobs: Knobs):
        """knobs: the clgpt.device.knobs switches its caller read (clgpt.device.knobs.read)."""
        from clgpt.inference.kvcache import KVCache
        from clgpt.models.factory import make_engine  # import here: reading a GGUF must not need OpenCL

        self.cfg = cfg
        self.engine = make_engine(cfg, params, batch_size=1, seq_len=cfg.n_ctx, device=device, knobs=knobs)
        self.cache = KVCache(self.engine)

    def _checked(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)[-self.cfg.n_ctx :]
        if not ids:
            raise ClgptError("cannot predict from an empty prompt; start it with the BOS token")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise ClgptError(f"token id {bad[0]} is not in the vocabulary (0..{self.cfg.vocab_size - 1})")
        return ids

    def _padded(self, ids: list[int]) -> np.ndarray:
        T = min(-(-len(ids) // PAD_TO) * PAD_TO, self.cfg.n_ctx)
        tokens = np.zeros((1, T), dtype=np.int32)  # (1, T'), padded with id 0 after the prefix
        tokens[0, : len(ids)] = ids
        return tokens

    def next_logits(self, ids: Sequence[int]) -> np.ndarray:
        """(V,) float32 logits for the token after `ids` (only the last n_ctx ids are seen), by a full forward."""
        ids = self._checked(ids)
        return np.array(self.engine.forward(self._padded(ids))[0, len(ids) - 1], dtype=np.float32)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """(V,) logits after `ids` (the last n_ctx), leaving them in the key/value cache for `decode`."""
        ids = self._checked(ids)
        return self.cache.prefill(self._padded(ids), [len(ids) - 1])[0]

    def decode(self, token: int, pos: int) -> np.ndarray:
        """(V,) logits after `token` at position `pos`, the cache holding positions 0..pos-1."""
        return self.cache.step([token], [pos])[0]

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 64, **kw) -> list[tuple[int, float]]:
        """The list `stream` yields (same arguments)."""
        return list(self.stream(prompt_ids, max_tokens, **kw))

    def stream(
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
    ) -> Iterator[tuple[int, float]]:
        """(token id, its probability under the distribution it was drawn from) for each new token, as it comes.

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
        n = len(self._checked(prompt_ids))
        if max_tokens == 0 or n >= self.cfg.n_ctx:
            return
        logits = self.prefill(prompt_ids)
        for k in range(max_tokens):
            if greedy:
                p = sampling_probs(logits, suppress_ids=suppress)
                token = int(np.argmax(p))
            else:
                p = sampling_probs(logits, temperature, top_k, top_p, suppress)
                token = int(min(np.searchsorted(np.cumsum(p), rng.random(), side="right"), p.size - 1))
                while p[token] == 0.0:  # cumsum rounding at the top edge: step back to a live token
                    token -= 1
            if token in stop:
                return
            yield token, float(p[token])
            if k + 1 == max_tokens or n + k + 1 >= self.cfg.n_ctx:
                return
            logits = self.decode(token, n + k)
