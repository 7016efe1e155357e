"""Picking the next token for :meth:`sdpa.nn.DecoderLM.generate`: its checks and its sampler.

Greedy decoding takes the most likely token; sampling draws from the softmax of the logits
divided by a temperature, optionally among the ``top_k`` most likely tokens only. Both break
ties by the lowest token id, as a stable sort in decreasing order ranks them.
"""

from __future__ import annotations

from numbers import Real

import numpy as np

from .._checks import check_bool, check_nonneg_int, check_rng
from ..softmax_stable import softmax
from .config import DecoderConfig

__all__: list[str] = []  # the model's own machinery: no public names


def check_generation(
    config: DecoderConfig, T0: int, max_new_tokens, temperature, top_k, rng, use_cache
) -> int:
    """Check :meth:`~sdpa.nn.DecoderLM.generate`'s options for a prompt of ``T0`` tokens;
    return ``max_new_tokens`` as an int."""
    n_new = check_nonneg_int(max_new_tokens, "max_new_tokens")
    if T0 + n_new > config.max_len:
        raise ValueError(
            f"the prompt's T0={T0} tokens plus max_new_tokens={n_new} exceed "
            f"max_len={config.max_len}"
        )
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, Real):
        raise TypeError(f"temperature must be a real number; got {temperature!r}")
    if not (np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0; got {temperature!r}")
    if top_k is not None:
        top_k = check_nonneg_int(top_k, "top_k")
        if not 1 <= top_k <= config.vocab_size:
            raise ValueError(
                f"top_k must be in [1, vocab_size={config.vocab_size}] or None; got {top_k}"
            )
    if temperature > 0 and rng is None:
        raise TypeError("sampling (temperature > 0) needs rng=np.random.default_rng(seed)")
    if rng is not None:
        check_rng(rng)
    check_bool(use_cache, "use_cache")
    return n_new


def pick_tokens(logits: np.ndarray, temperature: float, top_k: int | None, rng) -> np.ndarray:
    """One token per row of ``logits`` ``(B, V)``: greedy, or sampled by inverse CDF.

    >>> logits = np.array([[0.0, 2.0, 2.0], [5.0, 1.0, 0.0]])
    >>> pick_tokens(logits, 0.0, None, None)          # greedy: ties go to the lowest id
    array([1, 0])
    >>> rng = np.random.default_rng(0)
    >>> [int(pick_tokens(logits, 1.0, 1, rng)[1]) for _ in range(3)]  # top_k=1 is greedy
    [0, 0, 0]
    """
    if temperature == 0:
        return np.argmax(logits, axis=-1)  # the lowest id among the largest logits
    z = logits.astype(np.float64)  # (B, V)
    if top_k is not None:
        order = np.argsort(-z, axis=-1, kind="stable")  # (B, V), ties: lowest id first
        kept = np.zeros(z.shape, dtype=bool)  # (B, V)
        np.put_along_axis(kept, order[:, :top_k], True, axis=-1)  # exactly top_k per row
        z = np.where(kept, z, -np.inf)
    with np.errstate(over="ignore"):  # a tiny temperature: -inf for all but the largest
        z = (z - z.max(axis=-1, keepdims=True)) / temperature  # (B, V), <= 0
    cdf = np.cumsum(softmax(z, axis=-1), axis=-1)  # (B, V)
    u = rng.random((z.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=-1), z.shape[1] - 1)
