r"""A two-level memory that counts words moved, and attention algorithms that run on it.

FlashAttention's argument is about memory traffic, not arithmetic: a GPU computes far faster
than it can read its high-bandwidth memory (HBM), so an algorithm's cost is the number of words
it moves between that slow memory and the small on-chip SRAM. This package makes the argument
executable with the machine of the FlashAttention paper's analysis:

* **slow memory** is unbounded: here, ordinary NumPy arrays;
* **fast memory** holds at most ``M`` words (``capacity``): a :class:`TwoLevelMemory` keeps
  every array an algorithm has placed there under a name, and raises
  :class:`FastMemoryOverflow` the moment the named arrays would exceed ``M`` words;
* a **load** copies words from slow to fast memory and a **store** copies them back; both are
  counted, one word per array element. Arithmetic on arrays in fast memory is free, and is
  assumed to be done in place: only the arrays an algorithm names take space.

Three algorithms run on it, each computing the real attention output (so a test can check that
the simulated algorithm is attention) while the memory counts what it moved:

* :func:`textbook_attention_io`, the paper's Algorithm 0 ("standard attention"): the scores go
  to slow memory, the softmax reads them back and writes the weights, ``P V`` reads those;
* :func:`flash_attention_io`, FlashAttention's Algorithm 1: the outer loop over key/value
  blocks, the inner loop over query blocks, which read and write their output, ``l`` and ``m``
  at every step;
* :func:`flash_attention2_io`, the loop order of FlashAttention-2 (and of
  :func:`sdpa.blocked_attention`): the outer loop over query blocks, whose output and running
  statistics stay in fast memory until the block is finished.

With ``N`` queries and keys and width ``d``, the first moves :math:`\Theta(N d + N^2)` words and
the other two :math:`\Theta(N^2 d^2 / M)` (FlashAttention, Theorem 2), for
:math:`d \le M \le N d`. The functions' Notes derive the exact counts.

**Causal attention.** With ``is_causal=True`` (query ``i`` attends the keys ``j <= i``, aligned
top left) the two blocked algorithms skip every tile entirely above the diagonal, with the
loads and stores it would have cost, and mask inside the tiles the diagonal crosses, as
:func:`sdpa.blocked_attention` does. For ``T = S = N`` their quadratic term halves as ``N``
grows.

**Block sizes.** The paper sets :math:`B_c = \lceil M / 4d \rceil` and
:math:`B_r = \min(\lceil M / 4d \rceil, d)`. Those sizes fit in :math:`O(M)` words, not in
``M``: the blocks of ``K`` and ``V`` alone take :math:`2 B_c d \ge M / 2`, and the blocks of
``Q``, ``O`` and the scores up to :math:`3M/4` more. On a machine that enforces ``M`` we keep
the rule's orders of magnitude and make the blocks fit: the block of the outer loop (the one
the analysis wants large) gets as many rows as fill half of fast memory, which is
:math:`\lfloor M / 4d \rfloor` for the key/value blocks of Algorithm 1; the inner block is the
largest size up to :math:`\min(\text{outer}, d)` whose working set, counted word by word,
still fits (:func:`flash_block_sizes`).
"""

from .algorithms import flash_attention2_io, flash_attention_io, textbook_attention_io
from .block_sizes import flash_block_sizes, textbook_block_size
from .machine import FastMemoryOverflow, IOCount, TwoLevelMemory

__all__ = [
    "FastMemoryOverflow",
    "IOCount",
    "TwoLevelMemory",
    "flash_attention2_io",
    "flash_attention_io",
    "flash_block_sizes",
    "textbook_attention_io",
    "textbook_block_size",
]
