"""Test cases shared by several test modules: the default sizes and the mask shapes that
broadcast against ``(B, H, T, S)`` scores. Imported as ``cases`` (``tests/conftest.py`` puts
this folder on the path)."""

from __future__ import annotations

#: Batch, heads, queries, keys, key width, value width: all different, so that a transposed or
#: broadcast axis cannot go unnoticed.
B, H, T, S, DK, DV = 2, 3, 5, 7, 11, 4

#: Attention-mask shapes that broadcast against (B, H, T, S), from one row to the whole tensor.
MASK_SHAPES = [
    (S,),
    (T, S),
    (1, S),
    (T, 1),
    (1, T, 1),
    (H, 1, S),
    (B, 1, 1, S),
    (B, H, T, S),
    (B, 1, T, S),
    (1, 1, 1, 1),
    (H, T, S),
    (B, H, 1, 1),
]
