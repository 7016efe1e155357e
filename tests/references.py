"""Independent references shared by the tests: float64 loops written from the definitions.

Nothing here calls ``sdpa``: each function computes what a test compares ``sdpa`` with, one
entry at a time (``math.fsum`` for the sums), so that an error in the package cannot be
reproduced here. The tests import it as ``references`` (``tests/conftest.py`` puts this folder
on the path).
"""

from __future__ import annotations

import math
import warnings

import numpy as np


def attention_loop_2d(q, k, v, allowed=None, bias=None, scale=None, sinks=None):
    """One (T, Dk) x (S, Dk) x (S, Dv) problem with Python loops and math.fsum, in float64.

    ``allowed`` (T, S) bool: False entries are left out of the softmax. ``bias`` (T, S) float:
    added to the scaled scores. ``sinks`` (T,): a sink logit per row, one more term of the
    normaliser with no value (``exp(z_ij) / (sum_j exp(z_ij) + exp(s_i))``), included in the
    lse. Fully masked rows give out 0, weights 0, and lse -inf (or the row's sink).
    """
    T_, Dk = q.shape
    S_, Dv = v.shape
    if scale is None:
        scale = 1.0 / math.sqrt(Dk) if Dk else 1.0
    out = np.zeros((T_, Dv))
    weights = np.zeros((T_, S_))
    lse = np.full(T_, -np.inf)
    for i in range(T_):
        scores = {}
        for j in range(S_):
            if allowed is not None and not allowed[i, j]:
                continue
            s = scale * math.fsum(float(q[i, d]) * float(k[j, d]) for d in range(Dk))
            if bias is not None:
                s += float(bias[i, j])
            if s != -math.inf:
                scores[j] = s
        sink = [] if sinks is None else [float(sinks[i])]
        terms = [*scores.values(), *sink]
        if not terms or max(terms) == -math.inf:
            continue
        m = max(terms)
        total = math.fsum(math.exp(s - m) for s in terms)
        lse[i] = m + math.log(total)
        for j, s in scores.items():
            weights[i, j] = math.exp(s - m) / total
        for d in range(Dv):
            out[i, d] = math.fsum(weights[i, j] * float(v[j, d]) for j in scores)
    return out, weights, lse


def band_by_loop(T_, S_, *, is_causal=False, window=None, alignment="top_left"):
    """The causal/window band from its definition, one ``(i, j)`` at a time; True = may attend.

    Query ``i`` sits at key position ``i + o`` (``o = S - T`` under bottom-right alignment) and
    may attend key ``j`` when ``j <= i + o`` (causal) and ``i + o - left <= j <= i + o + right``.
    """
    o = 0 if alignment == "top_left" else S_ - T_
    band = np.ones((T_, S_), dtype=bool)
    for i in range(T_):
        for j in range(S_):
            if is_causal and j > i + o:
                band[i, j] = False
            if window is not None:
                left, right = window
                if left is not None and j < i + o - left:
                    band[i, j] = False
                if right is not None and j > i + o + right:
                    band[i, j] = False
    return band


def attention_loop(
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    *,
    alignment="top_left",
    window=None,
    scale=None,
    enable_gqa=False,
):
    """The batched reference: broadcast explicitly, then one loop_attention_2d per slice.

    With ``enable_gqa`` query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T_, S_ = q.shape[-2], k.shape[-2]
    if enable_gqa:
        Hq, Hkv = q.shape[-3], k.shape[-3]
        lead = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        full = (*lead, Hq)
        kv_full = (*lead, Hkv)
        group = Hq // Hkv
    else:
        full = kv_full = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        group = 1
    qf = np.broadcast_to(q, (*full, T_, q.shape[-1]))
    kf = np.broadcast_to(k, (*kv_full, S_, k.shape[-1]))
    vf = np.broadcast_to(v, (*kv_full, S_, v.shape[-1]))
    band = band_by_loop(T_, S_, is_causal=is_causal, window=window, alignment=alignment)
    mask = None if attn_mask is None else np.broadcast_to(attn_mask, (*full, T_, S_))
    out = np.zeros((*full, T_, v.shape[-1]))
    weights = np.zeros((*full, T_, S_))
    lse = np.zeros((*full, T_))
    for idx in np.ndindex(*full):
        kv_idx = (*idx[:-1], idx[-1] // group) if enable_gqa else idx
        allowed, bias = band, None
        if mask is not None and mask.dtype == bool:
            allowed = band & mask[idx]
        elif mask is not None:
            bias = mask[idx]
        out[idx], weights[idx], lse[idx] = attention_loop_2d(
            qf[idx], kf[kv_idx], vf[kv_idx], allowed, bias, scale
        )
    return out, weights, lse


def central_differences(f, x, eps=1e-6):
    """Gradient of the scalar ``f`` at ``x``, one entry at a time (separate from sdpa.gradcheck)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = eps
        grad[idx] = (f(x + e) - f(x - e)) / (2 * eps)
    return grad


def torch_flex(torch, q, k, v, score_mod=None, mask_mod=None, B=None, H=None, block=16, gqa=False):
    """PyTorch's eager FlexAttention on CPU (the unfused path, exact in float64): ``out``,
    ``lse`` and its block mask (None without ``mask_mod``), as NumPy arrays. ``torch`` is the
    tests' fixture; the mask is made for ``B`` batch entries and ``H`` heads (None: all)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    with warnings.catch_warnings():
        # eager flex_attention warns that it is not fused (it materialises the scores): only that
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        mask = None
        if mask_mod is not None:
            T, S = q.shape[-2], k.shape[-2]
            mask = create_block_mask(mask_mod, B, H, T, S, device="cpu", BLOCK_SIZE=block)
        out, aux = flex_attention(
            *(torch.from_numpy(x) for x in (q, k, v)),
            score_mod=score_mod,
            block_mask=mask,
            enable_gqa=gqa,
            return_aux=AuxRequest(lse=True),
        )
    return out.numpy(), aux.lse.numpy(), mask
