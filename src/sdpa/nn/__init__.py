"""A small language model in NumPy: Transformer layers with hand-derived gradients, AdamW.

``sdpa.nn`` builds a decoder-only Transformer on top of the attention of ``sdpa``. Every
piece is a plain function with a partner ``*_backward`` that returns the gradients of
``sum(d_y * f(...))`` (the vector-Jacobian product backpropagation needs), checked in the tests
against central finite differences and against ``torch.autograd``.

Functions (``sdpa.nn.functional``, ``sdpa.nn.softcap``, ``sdpa.nn.losses``)
    :func:`linear`, :func:`layer_norm`, :func:`rms_norm`, :func:`gelu`, :func:`softcap`,
    :func:`cross_entropy` and their backward passes; :func:`embedding_backward`.
Optimiser (``sdpa.nn.optim``)
    :class:`AdamW`, step for step equal to ``torch.optim.AdamW``.
Model (``sdpa.nn.model``, ``sdpa.nn.config``)
    :class:`DecoderLM`: forward pass, loss and gradients, generation with a KV cache; its
    sizes and options in a :class:`DecoderConfig`, checked once.
Serving (``sdpa.nn.serving``, over ``sdpa.nn.packed``, ``sdpa.nn.scheduler``, ``sdpa.nn.speculative``)
    :class:`LLMEngine`: many requests at once, one batched pass per step over a paged KV
    cache, with chunked prefill, prefix caching, preemption and speculative decoding; its
    counts in an :class:`EngineStats`.

>>> import numpy as np
>>> from sdpa.nn import AdamW, DecoderLM
>>> model = DecoderLM(vocab_size=5, d_model=8, n_layers=1, n_heads=2, max_len=8,
...                   rng=np.random.default_rng(0))
>>> tokens = np.array([[0, 1, 2, 3, 4, 0, 1, 2]])   # learn to count modulo 5
>>> inputs, targets = tokens[:, :-1], tokens[:, 1:]
>>> opt = AdamW(model.params, lr=0.05)
>>> first = model.loss_and_grads(inputs, targets)[0]
>>> for _ in range(50):
...     loss, grads = model.loss_and_grads(inputs, targets)
...     opt.step(grads)
>>> loss < 0.05 < first
True
"""

from .config import DecoderConfig
from .functional import (
    gelu,
    gelu_backward,
    layer_norm,
    layer_norm_backward,
    linear,
    linear_backward,
    rms_norm,
    rms_norm_backward,
)
from .losses import cross_entropy, cross_entropy_backward, embedding_backward
from .mla import LatentKVCache, MultiHeadLatentAttention
from .model import DecoderLM
from .optim import AdamW
from .serving import EngineStats, LLMEngine
from .softcap import softcap, softcap_backward

__all__ = [
    "AdamW",
    "DecoderConfig",
    "DecoderLM",
    "EngineStats",
    "LLMEngine",
    "LatentKVCache",
    "MultiHeadLatentAttention",
    "cross_entropy",
    "cross_entropy_backward",
    "embedding_backward",
    "gelu",
    "gelu_backward",
    "layer_norm",
    "layer_norm_backward",
    "linear",
    "linear_backward",
    "rms_norm",
    "rms_norm_backward",
    "softcap",
    "softcap_backward",
]
