"""Layer patterns of current models and what their caches cost; RoPE scaling as shipped; MLA's
two forms in serving.

Serves *Layer patterns and what they cost* (``book/measured/layer-patterns.md``), the RoPE page's
section on scaling types (``book/modern/rope.md``) and the serving section of *Multi-head latent
attention* (``book/measured/latent-attention.md``).

* :func:`kv_bytes_per_token` is the plain count a KV calculator needs, with an argument for
  layers that reuse another layer's keys and values;
* :class:`LayerKind` and :class:`ModelPattern` describe a model's attention layers by kind
  (global, windowed, latent, linear with a fixed state) and give its cache at any length:
  a window layer holds ``min(T, window)`` tokens, a global layer ``T``, a linear layer a state
  that does not grow; :data:`MODELS` holds the rows of the page's table, each with its source;
* :func:`llama3_inv_freq`, :func:`dynamic_ntk_base` and :func:`longrope_inv_freq` compute the
  frequencies of Hugging Face's ``llama3``, ``dynamic`` and ``longrope`` scaling types;
* :func:`mla_attention_flops` counts the FLOPs of MLA's naive and absorbed forms for ``T``
  query tokens over ``S`` keys, and :func:`mla_crossover` the ``T`` where they cost the same.

>>> kv_bytes_per_token(32, 8, 128)          # Llama 3.1 8B in bf16: 128 KiB a token
131072
>>> gemma3 = MODELS["Gemma 3 27B"]
>>> round(gemma3.cache_bytes(131072) / 2**30, 2)    # GiB at 128K tokens
10.41
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sdpa_book.checks import check_count

__all__ = [
    "MODELS",
    "LayerKind",
    "ModelPattern",
    "dynamic_ntk_base",
    "kv_bytes_per_token",
    "llama3_inv_freq",
    "longrope_inv_freq",
    "mla_attention_flops",
    "mla_crossover",
]


def kv_bytes_per_token(
    layers: int, kv_heads: int, head_dim: int, *, dtype_bytes: int = 2, shared_layers: int = 0
) -> int:
    """Bytes of keys and values one token adds to the cache of a model of global layers.

    Parameters
    ----------
    layers : int
        Attention layers of the model.
    kv_heads : int
        Key/value heads per layer, ``H_kv``.
    head_dim : int
        Width of one key (and one value), ``D_k``.
    dtype_bytes : int, default 2
        Bytes per number (2 for bfloat16 or float16).
    shared_layers : int, default 0
        How many of the ``layers`` read the keys and values of another layer instead of
        caching their own (cross-layer KV sharing: Gemma 3n's last 15 layers, YOCO's
        cross-decoder). ``0``: every layer caches.

    Returns
    -------
    int
        ``(layers - shared_layers) * 2 * kv_heads * head_dim * dtype_bytes``.

    Raises
    ------
    TypeError
        If an argument is not an int.
    ValueError
        If a size is below 1, or ``shared_layers`` is negative or not below ``layers``.

    Examples
    --------
    >>> kv_bytes_per_token(35, 2, 256), kv_bytes_per_token(35, 2, 256, shared_layers=15)
    (71680, 40960)
    """
    layers = check_count(layers, "layers", minimum=1)
    kv_heads = check_count(kv_heads, "kv_heads", minimum=1)
    head_dim = check_count(head_dim, "head_dim", minimum=1)
    dtype_bytes = check_count(dtype_bytes, "dtype_bytes", minimum=1)
    shared_layers = check_count(shared_layers, "shared_layers", minimum=0)
    if shared_layers >= layers:
        raise ValueError(
            f"shared_layers must be below layers ({layers}): some layer must cache the keys "
            f"and values the others read; got shared_layers={shared_layers}"
        )
    return (layers - shared_layers) * 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class LayerKind:
    """Layers of one kind, with the numbers each caches.

    Attributes
    ----------
    name : str
        What the layers are ("global", "window 1024", "Gated DeltaNet", "latent").
    layers : int
        Layers of this kind that keep a cache of their own.
    per_token : int
        Numbers one token adds to one layer's cache: ``2 H_kv D_k`` for keys and values,
        ``D_c + D_r`` for a latent, 0 for a linear layer.
    window : int or None
        Tokens a layer holds at most (a sliding window or an attention chunk); ``None``: all.
    state : int
        Numbers a layer holds whatever the length (a linear layer's state).
    compress : int, default 1
        Tokens pooled into one cached entry (DeepSeek-V4's compressed layers: 4 or 128);
        ``per_token`` then counts the numbers of one entry. Only whole groups are cached.
    beside : bool, default False
        The pool is kept by layers another kind of the model already counts (DeepSeek-V4's
        128-token window beside each layer's compressed entries).
    """

    name: str
    layers: int
    per_token: int
    window: int | None = None
    state: int = 0
    compress: int = 1
    beside: bool = False

    def __post_init__(self):
        check_count(self.layers, "layers", minimum=1)
        check_count(self.per_token, "per_token", minimum=0)
        check_count(self.state, "state", minimum=0)
        check_count(self.compress, "compress", minimum=1)
        if self.window is not None:
            check_count(self.window, "window", minimum=1)

    def tokens_held(self, T: int) -> int:
        """Tokens one layer holds after ``T`` tokens: ``min(T, window)`` or ``T``."""
        T = check_count(T, "T", minimum=0)
        return T if self.window is None else min(T, self.window)

    def entries(self, T: int) -> int:
        """Entries one layer caches after ``T`` tokens: its tokens, or their whole groups."""
        return self.tokens_held(T) // self.compress

    def numbers(self, T: int) -> int:
        """Numbers all layers of this kind hold after ``T`` tokens."""
        return self.layers * (self.entries(T) * self.per_token + self.state)


@dataclass(frozen=True)
class ModelPattern:
    """A model's attention layers by kind, and where the figures come from.

    Attributes
    ----------
    name : str
    kinds : tuple of LayerKind
        The layers that cache something, a kind kept ``beside`` another as a pool of its own.
    layers : int
        All attention layers, those that read another layer's cache included.
    source : str
        The published configuration or report the figures were checked against.
    note : str
        What the row assumes, if anything.
    """

    name: str
    kinds: tuple[LayerKind, ...]
    layers: int
    source: str
    note: str = ""

    def __post_init__(self):
        own = self.caching_layers()
        if own > self.layers:
            raise ValueError(f"{self.name}: {own} caching layers in kinds; layers={self.layers}")

    def caching_layers(self) -> int:
        """Layers that keep a cache of their own (a pool kept ``beside`` counted once)."""
        return sum(kind.layers for kind in self.kinds if not kind.beside)

    def cache_bytes(self, T: int, dtype_bytes: int = 2) -> int:
        """Bytes of the whole cache (all pools) of one sequence of ``T`` tokens."""
        return dtype_bytes * sum(kind.numbers(T) for kind in self.kinds)

    def growth_bytes_per_token(self, dtype_bytes: int = 2) -> float:
        """Bytes a token adds, on average, once every window is full: the global layers'
        share (a compressed layer's entry spread over the tokens it pools)."""
        return dtype_bytes * sum(
            k.layers * k.per_token / k.compress for k in self.kinds if k.window is None
        )


def _kv(heads: int, dim: int) -> int:
    return 2 * heads * dim  # a key and a value of width dim per key/value head


_HF = "https://huggingface.co/"
#: The rows of *Layer patterns and what they cost*, by name: each model's layers by kind, as its
#: published ``config.json`` (``source``) gives them; YOCO's row is an illustrative arrangement.
MODELS: dict[str, ModelPattern] = {
    m.name: m
    for m in [
        ModelPattern(
            "Llama 3.1 8B",
            (LayerKind("global", 32, _kv(8, 128)),),
            32,
            _HF + "meta-llama/Llama-3.1-8B/blob/main/config.json",
            "the plain baseline: every layer global",
        ),
        ModelPattern(
            "Gemma 2 27B",
            (
                LayerKind("window 4096", 23, _kv(16, 128), 4096),
                LayerKind("global", 23, _kv(16, 128)),
            ),
            46,
            _HF + "google/gemma-2-27b/blob/main/config.json",
            "local and global layers alternate; trained for 8K tokens",
        ),
        ModelPattern(
            "Gemma 3 27B",
            (
                LayerKind("window 1024", 52, _kv(16, 128), 1024),
                LayerKind("global", 10, _kv(16, 128)),
            ),
            62,
            _HF + "google/gemma-3-27b-it/blob/main/config.json",
            "5 local : 1 global (every sixth layer global)",
        ),
        ModelPattern(
            "Gemma 3n E4B",
            (LayerKind("window 512", 16, _kv(2, 256), 512), LayerKind("global", 4, _kv(2, 256))),
            35,
            _HF + "google/gemma-3n-E4B-it/blob/main/config.json",
            "4 local : 1 global; the last 15 layers reuse earlier layers' keys and values",
        ),
        ModelPattern(
            "gpt-oss-120b",
            (LayerKind("window 128", 18, _kv(8, 64), 128), LayerKind("global", 18, _kv(8, 64))),
            36,
            _HF + "openai/gpt-oss-120b/blob/main/config.json",
            "windows of 128 (with a learned sink per head) alternate with global layers",
        ),
        ModelPattern(
            "gpt-oss-20b",
            (LayerKind("window 128", 12, _kv(8, 64), 128), LayerKind("global", 12, _kv(8, 64))),
            24,
            _HF + "openai/gpt-oss-20b/blob/main/config.json",
            "as gpt-oss-120b, with 24 layers",
        ),
        ModelPattern(
            "Llama 4 Scout",
            (LayerKind("chunk 8192", 36, _kv(8, 128), 8192), LayerKind("global", 12, _kv(8, 128))),
            48,
            _HF + "meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json",
            "3 chunked RoPE layers : 1 global NoPE layer; a chunk layer counted at its worst, "
            "a whole chunk",
        ),
        ModelPattern(
            "Qwen3-Next-80B-A3B",
            (
                # state: 32 value heads of a (128 x 128) matrix, and the short convolution's
                # last 3 inputs of the 2 * 16 * 128 + 32 * 128 = 8192 channels it mixes
                LayerKind("Gated DeltaNet", 36, 0, state=32 * 128 * 128 + 3 * 8192),
                LayerKind("gated attention", 12, _kv(2, 256)),
            ),
            48,
            _HF + "Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json",
            "3 linear : 1 attention; the linear state counted at 2 bytes like the rest",
        ),
        ModelPattern(
            "DeepSeek-V3",
            (LayerKind("latent", 61, 512 + 64),),
            61,
            _HF + "deepseek-ai/DeepSeek-V3/blob/main/config.json",
            "MLA: a 512-wide latent and a 64-wide rotated key per token and layer",
        ),
        ModelPattern(
            "DeepSeek-V4-Pro",
            (
                # CSA: one entry per 4 tokens, a 512-wide latent and the indexer's 128-wide key
                LayerKind("CSA (4 tokens an entry)", 30, 512 + 128, compress=4),
                LayerKind("HCA (128 tokens an entry)", 31, 512, compress=128),
                LayerKind("window 128 beside the entries", 61, 512, 128, beside=True),
            ),
            61,
            "DeepSeek-AI (2026), V4 technical report; vLLM's DeepSeek-V4 notes (2026)",
            "sizes from the report and vLLM's notes, as the sparse-selection page assumes; "
            "every layer keeps a 128-token window beside its entries; compressor state "
            "(the last group's raw tokens) left out",
        ),
        ModelPattern(
            "YOCO (Llama 3.1 8B sizes)",
            (
                LayerKind("window 1024", 16, _kv(8, 128), 1024),
                LayerKind("shared global", 1, _kv(8, 128)),
            ),
            32,
            "Sun et al. (2024), arranged with Llama 3.1 8B's sizes",
            "illustrative, not a released model: 16 window layers, then 16 layers reading one "
            "shared cache",
        ),
    ]
}


# ---------------------------------------------------------------------------------------------
# RoPE scaling types, as Hugging Face's rope utilities define them


def _default_inv_freq(head_dim: int, base: float) -> np.ndarray:
    head_dim = check_count(head_dim, "head_dim", minimum=2)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (pairs of features); got {head_dim}")
    if not base > 1:
        raise ValueError(f"base must be above 1; got {base!r}")
    return float(base) ** (-np.arange(0, head_dim, 2) / head_dim)


def llama3_inv_freq(
    head_dim: int,
    base: float,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
) -> np.ndarray:
    """Frequencies of ``rope_type="llama3"``: fast pairs kept, slow pairs divided by ``factor``.

    A pair whose wavelength ``2 pi / theta`` is shorter than ``original_max_position /
    high_freq_factor`` keeps its frequency; one longer than ``original_max_position /
    low_freq_factor`` is divided by ``factor``; in between, the frequency is a mix of the two,
    ``(1 - w) theta / factor + w theta`` with ``w = (original_max_position / wavelength -
    low_freq_factor) / (high_freq_factor - low_freq_factor)``, which meets both ends.

    Parameters
    ----------
    head_dim : int
        ``D_k``, even.
    base : float
        RoPE's base (500000 for Llama 3).
    factor, low_freq_factor, high_freq_factor : float
        The ``rope_scaling`` entries (8, 1 and 4 for Llama 3.1).
    original_max_position : int
        The context the model was first trained for (8192 for Llama 3.1).

    Returns
    -------
    (head_dim // 2,) ndarray
        The new frequencies, fast to slow.

    Raises
    ------
    ValueError
        If ``high_freq_factor`` is not above ``low_freq_factor``, or a size is invalid.

    Examples
    --------
    >>> theta = llama3_inv_freq(128, 500000.0, factor=8.0, low_freq_factor=1.0,
    ...                         high_freq_factor=4.0, original_max_position=8192)
    >>> ratio = theta / (500000.0 ** (-np.arange(0, 128, 2) / 128))
    >>> float(ratio[0]), float(ratio[-1])
    (1.0, 0.125)
    """
    theta = _default_inv_freq(head_dim, base)
    if not high_freq_factor > low_freq_factor > 0:
        raise ValueError(
            "high_freq_factor must be above low_freq_factor, both positive; got "
            f"low_freq_factor={low_freq_factor!r}, high_freq_factor={high_freq_factor!r}"
        )
    wavelength = 2 * np.pi / theta
    w = (original_max_position / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    w = np.clip(w, 0.0, 1.0)  # 1 above the high-frequency edge, 0 below the low one
    return (1 - w) * theta / factor + w * theta


def dynamic_ntk_base(base: float, head_dim: int, *, factor: float, max_position: int, length: int):
    """The base ``rope_type="dynamic"`` uses for a sequence of ``length`` tokens.

    Dynamic NTK scaling recomputes the NTK-aware base from the current length at every
    forward pass: up to ``max_position`` tokens the base is unchanged (short prompts see the
    trained model exactly); beyond, it is ``base * (factor * length / max_position - (factor -
    1)) ** (D_k / (D_k - 2))``, which grows with the length.

    Examples
    --------
    >>> dynamic_ntk_base(10000.0, 128, factor=2.0, max_position=4096, length=4096)
    10000.0
    >>> round(dynamic_ntk_base(10000.0, 128, factor=2.0, max_position=4096, length=8192))
    30528
    """
    head_dim = check_count(head_dim, "head_dim", minimum=4)
    length = check_count(length, "length", minimum=1)
    max_position = check_count(max_position, "max_position", minimum=1)
    if length <= max_position:
        return float(base)
    stretch = factor * length / max_position - (factor - 1)
    return float(base) * stretch ** (head_dim / (head_dim - 2))


def longrope_inv_freq(
    head_dim: int,
    base: float,
    *,
    short_factor,
    long_factor,
    original_max_position: int,
    length: int,
) -> np.ndarray:
    """Frequencies of ``rope_type="longrope"``: each pair divided by its own searched factor.

    Two lists of ``D_k / 2`` factors ship with the model: ``short_factor`` for sequences up to
    ``original_max_position`` tokens, ``long_factor`` beyond.

    Examples
    --------
    >>> longrope_inv_freq(4, 100.0, short_factor=[1, 1], long_factor=[1, 4],
    ...                   original_max_position=8, length=16).tolist()
    [1.0, 0.025]
    """
    theta = _default_inv_freq(head_dim, base)
    length = check_count(length, "length", minimum=0)
    chosen = long_factor if length > original_max_position else short_factor
    chosen = np.asarray(chosen, dtype=np.float64)
    if chosen.shape != theta.shape:
        raise ValueError(
            f"short_factor and long_factor need one factor per pair, {theta.shape[0]}; "
            f"got shape {chosen.shape}"
        )
    return theta / chosen


# ---------------------------------------------------------------------------------------------
# MLA in serving


def mla_attention_flops(
    T: int, S: int, *, heads: int, d_latent: int, d_rope: int, d_nope: int, d_value: int
) -> dict[str, int]:
    """FLOPs of one MLA layer's attention, naive and absorbed, for ``T`` queries over ``S`` keys.

    Counted: what differs between the forms (two FLOPs a multiply-add). The query's own
    projections, the rotated key and the output projection are the same in both and left out.

    * naive: up-project the ``S`` latents into every head's key and value
      (``S D_c H (D_n + D_v)``), then ordinary attention with keys of width ``D_n + D_r``
      and values of width ``D_v`` (``T S H (D_n + D_r + D_v)``);
    * absorbed: map each query into the latent's coordinates (``T H D_n D_c``), attend over
      the latents with keys of width ``D_c + D_r`` and values of width ``D_c``
      (``T S H (2 D_c + D_r)``), then up-project each head's output (``T H D_c D_v``).

    Examples
    --------
    >>> f = mla_attention_flops(1, 1000, heads=1, d_latent=4, d_rope=2, d_nope=3, d_value=3)
    >>> f["naive"], f["absorbed"]       # 2 (4 * 6 * 1000 + 8 * 1000), 2 (12 + 10 * 1000 + 12)
    (64000, 20048)
    """
    T, S = check_count(T, "T", minimum=1), check_count(S, "S", minimum=1)
    H, Dc, Dr = heads, d_latent, d_rope
    Dn, Dv = d_nope, d_value
    naive = S * Dc * H * (Dn + Dv) + T * S * H * (Dn + Dr + Dv)
    absorbed = T * H * Dn * Dc + T * S * H * (2 * Dc + Dr) + T * H * Dc * Dv
    return {"naive": 2 * naive, "absorbed": 2 * absorbed}


def mla_crossover(S: int, *, d_latent: int, d_nope: int, d_value: int) -> float:
    """The number of query tokens ``T`` at which both forms cost the same over ``S`` keys.

    Setting the two counts of :func:`mla_attention_flops` equal (``H`` and ``D_r`` cancel)
    gives ``T = S D_c (D_n + D_v) / (D_c (D_n + D_v) + S (2 D_c - D_n - D_v))``; below it the
    absorbed form is cheaper. For long caches it tends to ``D_c (D_n + D_v) / (2 D_c - D_n -
    D_v)``.

    Examples
    --------
    >>> round(mla_crossover(10**9, d_latent=512, d_nope=128, d_value=128), 2)
    170.67
    """
    S = check_count(S, "S", minimum=1)
    up = d_latent * (d_nope + d_value)
    extra = 2 * d_latent - d_nope - d_value
    if extra <= 0:
        return math.inf  # the absorbed form is never more expensive per key
    return S * up / (up + S * extra)
