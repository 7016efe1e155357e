r"""Diagrams of how data flows through attention, drawn from a page's own sizes and arrays.

Every diagram here is a function of the sizes (or arrays) a page computes, so its shape labels
are the page's shapes and cannot drift from the text: change ``T`` on the page and the grids,
their proportions and their labels change with it. Each function returns a Matplotlib
``matplotlib.figure.Figure`` with a white background, at most
``sdpa_book.figures.FULL_WIDTH`` inches wide, with no text under
``sdpa_book.figures.MIN_FONT_PT`` points. The figures are not registered with pyplot (no
window, nothing to close); a page glues them like any other figure.

Diagrams
--------
:func:`token_qkv_diagram`
    One token's embedding becoming a query, a key and a value.
:func:`attention_pipeline_diagram`
    ``Q, K -> scores -> scale -> mask -> softmax -> weights -> @ V -> out``, with shapes.
:func:`multihead_diagram`, :func:`grouped_heads_diagram`
    Heads split, attend and concatenate; query heads sharing key/value heads (MHA, GQA, MQA).
:func:`mask_geometry_diagram`
    Causal, padding and sliding-window masks, and the two causal alignments when ``T != S``.
:func:`kv_cache_diagram`
    Prefill, then decoding one token at a time against a growing cache.
:func:`flash_loop_diagram`
    The tiled (FlashAttention) loop: slow memory, fast memory, the running ``m``, ``ℓ``.
:func:`backward_graph_diagram`
    The forward's stages and the gradients flowing back.
:func:`latent_attention_diagram`
    Multi-head latent attention: the latent and the rotated key cached, each head's key and
    value recomputed from the latent.
:func:`transformer_block_diagram`
    The residual stream with pre-norm or post-norm sublayers.
:func:`gpu_blocks_diagram`
    A GPU's thread blocks over query tiles, and where their data lives.
:func:`block_table_diagram`
    Sequences' blocks in a paged pool, drawn from a live :class:`sdpa.PagedKVCache`.

Drawing helpers
---------------
The diagrams are built from a few helpers, usable on their own: :func:`new_canvas` (a figure
whose data coordinates are inches), :func:`draw_box`, :func:`draw_arrow`, :func:`draw_matrix`
(a grid whose proportions follow its shape, labelled with the shape), :func:`draw_bracket`,
:func:`role_legend` and :func:`text_size`. Two readers serve tests and examples:
:func:`figure_texts` (the texts a figure shows) and :func:`tagged_rects` (where its grids and
boxes are, by name).

Every size is validated up front (a positive integer, shapes that agree, few enough cells to
draw legibly), with an error that names the argument.

Colours have one role each, the same on every diagram and plot of the book: queries
``sdpa_book.figures.QUERY``, keys ``sdpa_book.figures.KEY``, values
``sdpa_book.figures.VALUE``, outputs ``sdpa_book.figures.OUTPUT``, scores and weights
``SCORES``, gradients ``GRADIENT``, masks ``sdpa_book.figures.ALLOWED_COLOR`` and
``sdpa_book.figures.MASKED_COLOR``; memories ``SLOW_MEMORY`` and ``FAST_MEMORY``.
They are colours of the colour-blind-safe Okabe-Ito palette, or greys; the text is always dark
on a light tint, so the diagrams read the same on the book's light and dark pages (their
background is white).
"""

from __future__ import annotations

# One module per diagram (heads.py: the two of heads), built on primitives.py (roles, checks,
# geometry, packing, text), draw.py (canvas, boxes, arrows, brackets, legends) and matrix.py.
from .backward_graph import backward_graph_diagram
from .draw import (
    draw_arrow,
    draw_box,
    draw_bracket,
    figure_texts,
    new_canvas,
    role_legend,
    tagged_rects,
)
from .flash_loop import flash_loop_diagram
from .gpu_blocks import gpu_blocks_diagram
from .heads import grouped_heads_diagram, multihead_diagram
from .kv_cache import kv_cache_diagram
from .latent_attention import latent_attention_diagram
from .masks import mask_geometry_diagram
from .matrix import draw_matrix
from .paged import block_table_diagram
from .pipeline import attention_pipeline_diagram
from .primitives import FAST_MEMORY, GRADIENT, NEUTRAL, SCORES, SLOW_MEMORY, Rect, text_size
from .token_qkv import token_qkv_diagram
from .transformer_block import transformer_block_diagram

__all__ = [
    "FAST_MEMORY",
    "GRADIENT",
    "NEUTRAL",
    "SCORES",
    "SLOW_MEMORY",
    "Rect",
    "attention_pipeline_diagram",
    "backward_graph_diagram",
    "block_table_diagram",
    "draw_arrow",
    "draw_box",
    "draw_bracket",
    "draw_matrix",
    "figure_texts",
    "flash_loop_diagram",
    "gpu_blocks_diagram",
    "tagged_rects",
    "grouped_heads_diagram",
    "kv_cache_diagram",
    "latent_attention_diagram",
    "mask_geometry_diagram",
    "multihead_diagram",
    "new_canvas",
    "role_legend",
    "text_size",
    "token_qkv_diagram",
    "transformer_block_diagram",
]
