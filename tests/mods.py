"""Mask and score mods shared by the tests: one named generator per mod, as attention-gym's.

The one module of ``mask_mod`` and ``score_mod`` definitions for the tests (imported as
``mods``; ``tests/conftest.py`` puts this folder on the path). Written anew in NumPy after
meta-pytorch/attention-gym's ``attn_gym/masks/*.py`` and ``attn_gym/mods/*.py`` (commit
7fdb85d): each ``generate_*`` returns a function whose ``__name__`` says what it is and its
size (``sliding_window_3``). The mods are vectorised: they receive the four integer index
arrays ``b``, ``h``, ``q_idx``, ``kv_idx`` that :func:`sdpa.create_block_mask` and
:func:`sdpa.flex_attention` pass (broadcasting against each other) and return a bool array
(mask mods, True = may attend) or the modified scores (score mods).

sdpa has no ``and_masks`` / ``or_masks`` (PyTorch's combinators): :func:`and_masks` and
:func:`or_masks` here compose mask mods by hand. :func:`generate_chunked_causal` (Llama 4's
chunked attention) has no attention-gym counterpart at that commit.
"""

from __future__ import annotations

import functools

import numpy as np


def causal_mask(b, h, q_idx, kv_idx):
    """Query ``i`` may attend keys ``j <= i``."""
    return q_idx >= kv_idx


def _named(mod, name: str):
    mod.__name__ = mod.__qualname__ = name
    return mod


def and_masks(*mask_mods):
    """A mask mod that allows what every one of ``mask_mods`` allows."""
    if not mask_mods:
        raise ValueError("and_masks needs at least one mask_mod; got none")

    def mask(b, h, q_idx, kv_idx):
        return functools.reduce(np.logical_and, (m(b, h, q_idx, kv_idx) for m in mask_mods))

    return _named(mask, "and_" + "_".join(m.__name__ for m in mask_mods))


def or_masks(*mask_mods):
    """A mask mod that allows what any one of ``mask_mods`` allows."""
    if not mask_mods:
        raise ValueError("or_masks needs at least one mask_mod; got none")

    def mask(b, h, q_idx, kv_idx):
        return functools.reduce(np.logical_or, (m(b, h, q_idx, kv_idx) for m in mask_mods))

    return _named(mask, "or_" + "_".join(m.__name__ for m in mask_mods))


def generate_sliding_window(window_size: int):
    """Causal, and at most ``window_size`` positions back: ``0 <= i - j <= window_size``."""

    def in_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    return _named(and_masks(in_window, causal_mask), f"sliding_window_{window_size}")


def generate_prefix_lm_mask(prefix_length: int):
    """Every query sees the first ``prefix_length`` keys (the prefix), the rest causally."""

    def in_prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    return _named(or_masks(in_prefix, causal_mask), f"prefix_lm_causal_mask_{prefix_length}")


def generate_dilated_sliding_window(window_size: int, dilation: int):
    """``|i - j| <= window_size`` and ``|i - j|`` a multiple of ``dilation`` (both sides)."""

    def dilated_sliding_window(b, h, q_idx, kv_idx):
        diff = np.abs(q_idx - kv_idx)
        return (diff <= window_size) & (diff % dilation == 0)

    name = f"dilated_sliding_window_{window_size}_dilation_{dilation}"
    return _named(dilated_sliding_window, name)


def generate_chunked_causal(chunk_size: int):
    """Causal within chunks of ``chunk_size`` positions: ``i // c == j // c`` and ``j <= i``."""

    def same_chunk(b, h, q_idx, kv_idx):
        return q_idx // chunk_size == kv_idx // chunk_size

    return _named(and_masks(same_chunk, causal_mask), f"chunked_causal_{chunk_size}")


def generate_global_sliding_window(window_size: int, is_global):
    """Longformer's: ``|i - j| <= window_size``, or either position is a global token."""
    is_global = np.asarray(is_global, dtype=bool)

    def sliding_window(b, h, q_idx, kv_idx):
        return np.abs(q_idx - kv_idx) <= window_size

    def global_attention(b, h, q_idx, kv_idx):
        return is_global[q_idx] | is_global[kv_idx]

    mask = or_masks(sliding_window, global_attention)
    return _named(mask, f"global_sliding_window_{window_size}")


def length_to_offsets(lengths) -> np.ndarray:
    """Document lengths ``[2, 4, 3]`` to offsets ``[0, 2, 6, 9]`` (where each one starts)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.intp)


def _document_ids(offsets: np.ndarray) -> np.ndarray:
    """The document of each position of the packed sequence."""
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


def generate_doc_mask_mod(mask_mod, offsets):
    """Documents packed in one sequence (jagged): attend within one's own document only, with
    ``mask_mod`` applied to the positions inside the document."""
    offsets = np.asarray(offsets, dtype=np.intp)
    document = _document_ids(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document[q_idx] == document[kv_idx]
        q_logical = q_idx - offsets[document[q_idx]]
        kv_logical = kv_idx - offsets[document[kv_idx]]
        return same_doc & mask_mod(b, h, q_logical, kv_logical)

    return _named(doc_mask_mod, f"document_{mask_mod.__name__}")


def generate_packed_causal_doc_mask_mod(offsets):
    """The causal document mask as one interval per query: keys from its document's start."""
    offsets = np.asarray(offsets, dtype=np.intp)
    document = _document_ids(offsets)

    def doc_causal_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[document[q_idx]]) & causal_mask(b, h, q_idx, kv_idx)

    return _named(doc_causal_mask_mod, "packed_causal_document")


def generate_alibi_bias(H: int):
    """ALiBi: head ``h`` adds ``2^(-8 (h + 1) / H) (j - i)`` to the score of ``(i, j)``."""

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score + np.exp2(-8.0 * (h + 1) / H) * (kv_idx - q_idx)

    return _named(alibi_mod, f"alibi_{H}_heads")


def generate_tanh_softcap(soft_cap: float):
    """Soft-capping (Gemma 2, Grok-1): every score squeezed into ``(-soft_cap, soft_cap)``."""

    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * np.tanh(score / soft_cap)

    return _named(tanh_softcap, f"tanh_softcap_{soft_cap:g}")


def dense_mask(mask_mod, B: int, H: int, T: int, S: int) -> np.ndarray:
    """``mask_mod`` on every ``(b, h, i, j)``: a ``(B, H, T, S)`` bool array."""
    b, h, q_idx, kv_idx = np.ix_(np.arange(B), np.arange(H), np.arange(T), np.arange(S))
    return np.broadcast_to(mask_mod(b, h, q_idx, kv_idx), (B, H, T, S))
