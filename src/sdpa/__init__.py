"""sdpa: scaled dot-product attention in NumPy, readable, tested against PyTorch.

Shape letters used throughout: ``B`` batch, ``H`` heads (``Hq``, ``Hkv`` when they differ),
``T`` query length, ``S`` key length, ``E`` model width, ``Dk`` query/key width per head,
``Dv`` value width per head, ``Bq``/``Bk`` tile sizes.

>>> import numpy as np
>>> import sdpa
>>> q = np.ones((2, 3, 4))  # (B, T, Dk)
>>> sdpa.scaled_dot_product_attention(q, q, q).shape
(2, 3, 4)
"""

# The small language model of Part VII is importable as sdpa.nn after `import sdpa`; its names
# stay out of sdpa.__all__, which is the attention API. Like every module of the package it
# imports what it uses from the modules that define it, never from this face.
from . import nn  # noqa: F401
from .alibi import alibi_bias, alibi_slopes
from .attention import scaled_dot_product_attention
from .backward import scaled_dot_product_attention_backward
from .block_mask import BlockMask, and_masks, create_block_mask, create_mask, noop_mask, or_masks
from .blocked import blocked_attention, blocked_attention_backward
from .finite_diff import gradcheck, numerical_gradient
from .flex import flex_attention
from .flex_call import AuxOutput, AuxRequest
from .kvcache import KVCache
from .linear import elu_feature_map, linear_attention
from .masks import causal_mask, padding_mask, sliding_window_mask
from .merge import merge_attention_states
from .multihead import MultiHeadAttention, merge_heads, split_heads
from .paged_kvcache import PagedKVCache
from .positional import sinusoidal_positional_encoding
from .rope import apply_rotary_embedding, rotary_cos_sin
from .softmax_grad import softmax_jacobian, softmax_vjp
from .softmax_stable import log_softmax, logsumexp, softmax
from .tiled import tile_map

__version__ = "0.1.0"

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "KVCache",
    "MultiHeadAttention",
    "PagedKVCache",
    "alibi_bias",
    "alibi_slopes",
    "and_masks",
    "apply_rotary_embedding",
    "blocked_attention",
    "blocked_attention_backward",
    "causal_mask",
    "create_block_mask",
    "create_mask",
    "elu_feature_map",
    "flex_attention",
    "gradcheck",
    "linear_attention",
    "log_softmax",
    "logsumexp",
    "merge_attention_states",
    "merge_heads",
    "noop_mask",
    "numerical_gradient",
    "or_masks",
    "padding_mask",
    "rotary_cos_sin",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "sinusoidal_positional_encoding",
    "sliding_window_mask",
    "softmax",
    "softmax_jacobian",
    "softmax_vjp",
    "split_heads",
    "tile_map",
]
