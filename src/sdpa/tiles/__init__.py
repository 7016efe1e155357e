r"""The engine under both tiled paths: :mod:`sdpa.tiled` (dense masks, biases, sinks) and the
tiled path of :mod:`sdpa.flex` (block masks and score mods) are two faces over it.

Attention is computed a block of query rows at a time, walking along the keys with the online
softmax of Milakov and Gimelshein (2018) as FlashAttention-2 arranges it, so that the
``(T, S)`` scores of a head are never held at once. The words below mean one thing each,
throughout the package:

**unit**
    One work unit: a block of query rows, of one head or of several heads *folded* together,
    walked along its keys from start to finish by one thread. Units are independent: what a
    unit computes depends on its inputs alone, so the bits of a result do not depend on the
    number of threads or on which thread took which unit (:mod:`sdpa.tiles.workers`).
**fold**
    To put into one matrix product what would otherwise take several: heads folded into one
    unit's rows (the query heads that share a key/value head, whether grouped queries or a
    batch axis along which the keys and values do not vary, and under flex several key heads
    at once when the mask does not depend on the head), so that each key tile is loaded once
    for all of them; and in the dense face a row's shift folded into the product as one more
    column, ``[q | -m] @ [k | 1]``, so that no pass subtracts it.
**piece**
    The keys of one step of a unit's walk: one matrix product of the unit's queries with
    them, one exponential, one product with their values. A piece is *full* (every score of
    it allowed: no mask applied) or *partial* (a mask applies). The dense face cuts the keys
    the causal/window band allows into pieces at multiples of ``BLOCK_K`` (``BLOCK_K_BAND``
    under a band), each trimmed to the keys the band allows some query of the unit (a causal
    row of pieces stops at the diagonal); a piece meets only the *run* of the unit's rows
    that its keys are allowed to (a causal unit walks its diagonal as a staircase of
    strips), and of a piece the band's edge crosses only the rows it crosses are masked
    (:mod:`sdpa.tiles.band`). The flex face gathers a block mask's non-empty blocks of one
    kind (:mod:`sdpa.tiles.blocks`). In both faces a causal unit of several *squares* (of
    ``BLOCK_K_BAND`` rows, each with the keys of its own diagonal) computes the squares apart
    and all at once: a piece of ``BLOCK_K_DIAGONAL`` keys of every square, one batched
    product for them all, each for the rows of its square at and below its keys.
**plan**
    Everything a face derives from the shapes and the mask before any unit runs: the units,
    each one's pieces, the heads folded, the exponential's base. Plans never depend on the
    values of the inputs.
**step**
    Adding one piece to the online softmax (:mod:`sdpa.tiles.softmax`): the *lazy* step
    keeps each row's shift, the *exact* step moves it to the new row maximum.

The engine's modules: :mod:`~sdpa.tiles.softmax` (the online softmax and the buffers of a
worker), :mod:`~sdpa.tiles.ranges` (values near the ends of the dtype's range),
:mod:`~sdpa.tiles.workers` (the threads, their counters), :mod:`~sdpa.tiles.band` (the dense
face's band geometry) and :mod:`~sdpa.tiles.blocks` (the flex face's block plans). Their
tunables are in :mod:`sdpa.tuning`, with the measurement that chose each.
"""

__all__: list[str] = []
