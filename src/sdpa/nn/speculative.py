r"""Speculative decoding for the serving engine: a draft proposes, the target verifies.

A small *draft* model proposes ``k`` tokens one at a time; the target scores all of them in
one pass (its logits at the last accepted token and at each proposal), and keeps the longest
run of proposals it agrees with, plus one token of its own:

- **greedy** (``temperature = 0``): proposal ``j`` is kept when it is the target's argmax at
  its position; the first disagreement is replaced by the target's argmax, and a run kept
  whole earns the target's next argmax as a bonus. The tokens are those of greedy decoding
  with the target alone.
- **sampling** (Leviathan et al. 2023; Chen et al. 2023): proposal ``d`` drawn from the
  draft's distribution ``q`` is kept with probability ``min(1, p(d) / q(d))``, ``p`` the
  target's; the first rejected one is replaced by a draw from ``max(0, p - q)``, normalised.
  Each token emitted is then distributed exactly as ``p`` (the target's), whatever ``q``.

Both distributions are those :meth:`sdpa.nn.DecoderLM.generate` samples from: the logits
divided by the temperature, among the ``top_k`` most likely tokens when given.
"""

from __future__ import annotations

import numpy as np

from ..softmax_stable import softmax
from .generation import pick_tokens

__all__: list[str] = []  # the engine's machinery: no public names


def token_probs(logits: np.ndarray, temperature: float, top_k: int | None) -> np.ndarray:
    """The distribution ``(V,)`` that :func:`~sdpa.nn.generation.pick_tokens` samples from."""
    z = logits.astype(np.float64)
    if top_k is not None:
        kept = np.zeros(z.shape, dtype=bool)
        kept[np.argsort(-z, kind="stable")[:top_k]] = True  # ties: the lowest ids
        z = np.where(kept, z, -np.inf)
    with np.errstate(over="ignore"):  # a tiny temperature: -inf for all but the largest
        return softmax((z - z.max()) / temperature)


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``p`` ``(V,)`` by inverse CDF, one uniform draw."""
    cdf = np.cumsum(p)
    return int(min((cdf <= rng.random() * cdf[-1]).sum(), len(p) - 1))


def propose(draft, context: list[int], k: int, temperature: float, top_k, rng):
    """``k`` tokens continuing ``context`` from ``draft`` (through its own KV cache, outside
    the engine's pool), and the distribution each was drawn from (None when greedy)."""
    cache = draft._new_cache(1, len(context) + k)
    logits = draft._forward_cached(np.asarray([context]), cache, 0)[0, -1]
    tokens, dists = [], []
    for j in range(k):
        if temperature == 0:
            token, dist = int(np.argmax(logits)), None
        else:
            dist = token_probs(logits, temperature, top_k)
            token = _draw(dist, rng)
        tokens.append(token)
        dists.append(dist)
        if j + 1 < k:
            logits = draft._forward_cached(np.asarray([[token]]), cache, len(context) + j)[0, -1]
    return tokens, dists


def verify(logits: np.ndarray, proposal: list[int], dists, temperature, top_k, rng):
    """The tokens to emit, given the target's ``logits`` ``(k + 1, V)`` at the last token
    and at each of the ``k`` proposals; the first ``len(result) - 1`` are accepted proposals."""
    out = []
    for j, token in enumerate(proposal):
        if temperature == 0:
            best = int(np.argmax(logits[j]))
            out.append(best)
            if best != token:
                return out
            continue
        p, q = token_probs(logits[j], temperature, top_k), dists[j]
        if rng.random() * q[token] < p[token]:  # accepted with probability min(1, p / q)
            out.append(token)
            continue
        residual = np.maximum(p - q, 0.0)
        out.append(_draw(residual if residual.sum() > 0 else p, rng))
        return out
    out.append(int(pick_tokens(logits[-1:], temperature, top_k, rng)[0]))  # the bonus token
    return out
