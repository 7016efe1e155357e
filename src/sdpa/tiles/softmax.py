r"""The online softmax of one unit's rows, step by step, in a worker's own buffers.

A unit adds its keys piece by piece, keeping three running quantities per query row:

* ``m``, the row's *shift*: the largest score seen so far, or a value the lazy step has
  shown to be close enough to it;
* ``l``, the sum of ``exp(score - m)`` over the keys seen so far;
* ``acc``, the sum of ``exp(score - m) * v`` over the keys seen so far.

The steps (``OnlineSoftmax``):

**start**
    Every row starts at ``m = 0`` ("at zero": the first piece then needs no row maximum), or
    with no shift at all, to be set by the first exact step at the row's first allowed score.
**lazy step**
    Adds a piece at the rows' present shifts: ``p = exp(s - m)``, ``l += p @ 1``,
    ``acc += p @ v``: no row maximum, no subtraction when the shift is folded into the
    product, no rescaling. It is exact while no score exceeds its row's shift by more than
    ``LAZY_MARGIN`` (then no term overflows), which the piece's row sums prove: each term is
    at most its row's sum. A piece that breaks the bound changes nothing and is added again by
    the exact step.
**exact step**
    The online softmax as written: ``m_new = max(m, rowmax(s))``, the old sums rescaled by
    ``alpha = exp(m - m_new)``, the piece's terms ``exp(s - m_new) <= 1`` added. A row meeting
    its first allowed score starts at that piece's maximum.
**finish**
    ``out = acc / l`` and ``lse = m + log l`` in natural units; a row that met no allowed
    score (``l = 0``) gets ``out = 0`` and ``lse = -inf``; a sink (a logit with no value)
    joins the normaliser first.

A row that starts at zero must end with ``l >= LAZY_FLOOR``: its scores all lying more than
``LAZY_MARGIN`` below zero would lose digits to underflow. The face checks
(``sums_hold()``) and starts the unit again without the shift 0.

Scores may be in base 2 (``base2``): the query's scale times ``log2(e)``, so that the
exponential is ``exp2`` (the faster one where NumPy computes it with SVML, see
:func:`sdpa.tuning.tile_exponential`); ``m`` is then in units of ``ln 2`` and converted back
by ``finish()``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np

from ..tuning import LAZY_MARGIN, SCRATCH_BYTES

__all__: list[str] = []

LOG2E = 1 / math.log(2)  # 2 ** (x * LOG2E) = e ** x
LN2 = math.log(2)

# A piece is accepted by the lazy step when every row sum of exp(scores - m) is at most
# LAZY_BOUND, which bounds each term; a row that starts at m = 0 must end with l >= LAZY_FLOOR.
LAZY_BOUND = float(np.exp(LAZY_MARGIN))
LAZY_FLOOR = float(np.exp(-LAZY_MARGIN))

ALL = slice(None)  # every row of a unit


class ScratchPool:
    """Scratch buffers kept from one call to the next, up to ``max_bytes`` in all.

    A worker's buffer of scores is megabytes (up to ``UNIT_SCORES`` entries); taken fresh from
    the system at every call, each of its pages faults when first written. The pool keeps
    the buffers its callers give back (the largest first, within ``max_bytes``) and hands out
    the smallest one large enough. Its contents are never read: every piece writes its
    scores before it reads them. Safe from any thread: concurrent calls take different
    buffers.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, n: int, dtype) -> np.ndarray:
        """A flat array of ``n`` entries of ``dtype`` (a view of a kept buffer, or new)."""
        dtype = np.dtype(dtype)
        with self._lock:
            fits = [
                (b.size, i) for i, b in enumerate(self._free) if b.dtype == dtype and b.size >= n
            ]
            if fits:
                return self._free.pop(min(fits)[1])[:n]
        return np.empty(n, dtype)

    def give(self, view: np.ndarray) -> None:
        """Give back what :meth:`take` handed out; the pool keeps the largest buffers."""
        buffer = view if view.base is None else view.base
        with self._lock:
            kept, total = [], 0
            for b in sorted([*self._free, buffer], key=lambda b: -b.nbytes):
                if total + b.nbytes <= self.max_bytes:
                    kept.append(b)
                    total += b.nbytes
            self._free = kept


SCRATCH = ScratchPool(SCRATCH_BYTES)  # the workers' buffers of scores


class Workspace:
    """One worker thread's buffers, allocated once for the largest unit and piece of a plan.

    Each is flat and viewed at the size of the unit at hand, so a thread allocates nothing
    per piece: ``scores`` holds a piece's scores and then, in place, its terms
    ``exp(s - m)`` (taken from ``SCRATCH`` and given back by :meth:`release`); ``tile_out``
    and ``tile_l`` its products with the values and with ones; ``acc``, ``l`` and ``m`` the
    running state; ``top`` the largest ``|out|`` of each value column over the worker's units
    (:func:`sdpa.tiles.ranges.widen_column_top`).
    """

    def __init__(self, rows: int, keys: int, Dv: int, dtype: np.dtype):
        self.dtype = dtype
        self.scores = SCRATCH.take(rows * keys, dtype)
        self.tile_out = np.empty(rows * Dv, dtype)
        self.tile_l = np.empty(rows, dtype)
        self.acc = np.empty(rows * Dv, dtype)
        self.l = np.empty(rows, dtype)
        self.m = np.empty(rows, dtype)
        self.ones = np.ones(keys, dtype)
        self.top = np.zeros(Dv, dtype)

    def scores_view(self, shape: tuple[int, ...]) -> np.ndarray:
        """The scores buffer viewed as ``shape`` (its entries at most the buffer's)."""
        return self.scores[: math.prod(shape)].reshape(shape)

    def release(self) -> None:
        """Give the scores buffer back to ``SCRATCH``: the worker computes nothing more."""
        if self.scores is not None:
            SCRATCH.give(self.scores)
            self.scores = None


def _zeros(buffer: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` entries of ``buffer``, set to zero."""
    view = buffer[:n]
    view.fill(0)
    return view


class OnlineSoftmax:
    """The running state of one unit's ``rows`` query rows, in a :class:`Workspace`.

    Parameters
    ----------
    space : Workspace
        The worker's buffers (large enough for ``rows`` rows).
    rows : int
        The unit's query rows, folded heads one under the other.
    Dv : int
        Width of the values.
    exp : callable
        The pieces' exponential, applied in place as ``exp(x, out=x)``: ``numpy.exp2`` on
        scores in base 2, ``numpy.exp`` (or a stand-in the benchmark times) otherwise.
    base2 : bool
        Whether the scores (and so ``m``) are in base 2.
    at_zero : bool
        Start every row at the shift 0 (see :meth:`sums_hold`).
    groups : int, default 1
        The rows are ``groups`` equal blocks one under the other (the folded heads, each
        ``rows / groups`` query rows long). A step may add a piece to a *run* of rows only,
        the same run of each block (``run``, a slice of ``range(rows / groups)``): a causal
        piece meets only the rows at or below the diagonal.

    A step may also cut each group's rows into ``parts`` equal parts and add its piece to the
    same run of each part (``parts``, default 1): both faces add the squares along a causal
    diagonal so, one batched product for all of them.
    """

    def __init__(
        self,
        space: Workspace,
        rows: int,
        Dv: int,
        exp: Callable,
        base2: bool,
        at_zero,
        groups: int = 1,
    ):
        self.space, self.rows, self.Dv = space, rows, Dv
        self.exp, self.base2 = exp, base2
        self.base_exp = np.exp2 if base2 else np.exp  # the true exponential of the base
        self.groups, self.length = groups, rows // groups
        self.m = _zeros(space.m, rows)
        self.l = _zeros(space.l, rows)
        # acc is set by the first step that adds to every row (written, not added: no pass to
        # zero it, none to add to zeros), or zeroed before any other step (``fresh`` until then)
        self.acc = space.acc[: rows * Dv].reshape(rows, Dv)
        self.fresh = True
        self.started = np.full(rows, bool(at_zero))  # rows whose shift m is set
        self.all_started = bool(at_zero)
        self.moved = False  # whether an exact step has moved a shift (else every m is 0)
        self._views: dict[int, tuple[np.ndarray, ...]] = {}
        self.by_group = self.views(1)

    def views(self, parts: int) -> tuple[np.ndarray, ...]:
        """``(m, l, acc, started)`` with each group's rows cut into ``parts`` equal parts, one
        under the other: ``(groups parts, r)`` and, for ``acc``, ``(groups parts, r, Dv)``."""
        views = self._views.get(parts)
        if views is None:
            g, n = self.groups * parts, self.length // parts
            views = self._views[parts] = (
                self.m.reshape(g, n),
                self.l.reshape(g, n),
                self.acc.reshape(g, n, self.Dv),
                self.started.reshape(g, n),
            )
        return views

    def state(self, run: slice, parts: int = 1) -> tuple[np.ndarray, ...]:
        """Views ``(m, l, acc, started)`` of the rows ``run`` of every group (of every part of
        it): ``(groups parts, r)`` and, for ``acc``, ``(groups parts, r, Dv)``."""
        return tuple(a[:, run] for a in self.views(parts))

    def started_in(self, run: slice = ALL, parts: int = 1) -> bool:
        """Whether every row of ``run`` (of every group, or part) has its shift set."""
        return self.all_started or bool(self.views(parts)[3][:, run].all())

    def subtract_shift(self, s: np.ndarray, run: slice = ALL, parts: int = 1) -> None:
        """``s -= m`` row by row, for a face that does not fold the shift into its product;
        ``s`` is ``(..., keys)`` with the rows ``run`` of each group (or part) in order."""
        m = self.views(parts)[0][:, run]
        s3 = s.reshape(*m.shape, s.shape[-1])
        np.subtract(s3, m[..., None], out=s3)

    def lazy_step(
        self,
        p: np.ndarray,
        values: np.ndarray,
        disallowed=None,
        run: slice = ALL,
        masked=ALL,
        parts: int = 1,
    ) -> bool:
        """Add a piece at the present shifts; False (and nothing changed but ``p``) if it is
        not exact.

        ``p`` ``(..., r, keys)`` holds the piece's scores minus each row's shift, for the rows
        ``run`` (``r`` of them) of each group, and is overwritten with ``exp(p)``; ``values``
        is ``(n, keys, Dv)``, the values of the unit's ``n`` key heads (each for an equal share
        of the rows, in order), or of as many axes as ``p`` and more than three, broadcastable
        against it as ``(..., keys, Dv)`` (:meth:`products`); with ``parts``, ``p`` holds the
        rows ``run`` of each part; ``disallowed``, an array broadcastable to the rows
        ``masked`` of ``p`` (a slice of its ``r``), marks the scores to drop (None: every score is
        allowed): bools, True where a score is disallowed, or weights of ``p``'s dtype, 0
        there and 1 elsewhere (multiplied in: a term that is NaN or infinite then stays NaN
        and fails the bound, and the exact step, which drops the scores before the
        exponential, adds the piece instead). Disallowed terms are dropped after the
        exponential rather than set to ``-inf`` before it: SVML's ``exp2`` takes a slow path
        for ``-inf`` (a causal diagonal tile took 2.7 times as long). The row sums come
        first, so that a piece that fails the bound costs no product with the values.
        """
        self.exp(p, out=p)  # the terms, unnormalised: exp(s - m)
        if disallowed is not None:
            target = p[..., masked, :]
            if disallowed.dtype == bool:
                np.copyto(target, 0, where=disallowed)
            else:
                np.multiply(target, disallowed, out=target)
        tile_l = self.row_sums(p)
        if not tile_l.max() <= LAZY_BOUND:  # (NaN fails too)
            return False
        _, l, acc, _ = self.views(parts)
        l, acc = l[:, run], acc[:, run]
        if self.fresh and acc.size == self.acc.size:  # the first step, and it meets every row
            self.products(p, values, out=self.acc)
            self.fresh = False
        else:
            self.zero_fresh()
            acc += self.products(p, values).reshape(acc.shape)
        l += tile_l.reshape(l.shape)
        return True

    def exact_step(
        self,
        s: np.ndarray,
        values: np.ndarray,
        masked: bool = False,
        run: slice = ALL,
        parts: int = 1,
    ) -> None:
        """Add a piece, moving each row's shift to its largest score so far.

        ``s`` ``(..., r, keys)`` holds the raw scores (in the base of the softmax) of the rows
        ``run`` of each group (or part), ``-inf`` where disallowed, and is overwritten;
        ``masked`` says that it may hold such ``-inf``: then, in base 2, the exponential is
        ``exp(x ln 2)``, which has no slow path for ``-inf``. ``values`` as in
        :meth:`lazy_step`.
        """
        m, l, acc, started = self.state(run, parts)
        self.zero_fresh()
        s3 = s.reshape(*m.shape, s.shape[-1])  # (groups, r, keys)
        row_max = np.max(s3, axis=-1)  # -inf where nothing is allowed, NaN stays NaN
        meets = row_max > -np.inf
        m_new = np.where(started, np.maximum(m, row_max), np.where(meets, row_max, 0))
        alpha = np.where(started, self.base_exp(m - m_new), 0)  # exp(-inf) = 0: no overflow
        np.subtract(s3, m_new[..., None], out=s3)
        if masked and self.exp is np.exp2:
            np.multiply(s3, s3.dtype.type(LN2), out=s3)
            np.exp(s3, out=s3)
        else:
            self.exp(s3, out=s3)  # exp(s - m_new), at most 1
        tile_l = self.row_sums(s3)
        tile_out = self.products(s3, values)
        acc *= alpha[..., None]
        acc += tile_out.reshape(acc.shape)
        l *= alpha
        l += tile_l.reshape(l.shape)
        m[...] = m_new
        self.moved = True
        started |= meets
        self.all_started = bool(self.started.all())

    def zero_fresh(self) -> None:
        """Zero ``acc`` if no step has set it yet."""
        if self.fresh:
            self.acc.fill(0)
            self.fresh = False

    def row_sums(self, p: np.ndarray) -> np.ndarray:
        """``p @ 1``: the row sums of a piece's terms ``(..., keys)``, flat, in ``tile_l``."""
        keys = p.shape[-1]
        tile_l = self.space.tile_l[: p.size // keys]
        np.matmul(p.reshape(-1, keys), self.space.ones[:keys], out=tile_l)
        return tile_l

    def products(self, p: np.ndarray, values: np.ndarray, out=None) -> np.ndarray:
        """``p @ v`` per key head: ``(n, rows / n, keys) @ (n, keys, Dv)``, into ``tile_out``
        (returned, ``(n, rows / n, Dv)``); or, for ``values`` of more than three axes (as
        many as ``p``, broadcastable against its leading ones), ``p @ values``,
        ``(..., r, Dv)``. With ``out`` (contiguous, as many entries), into it instead.

        The row sums are a matrix-vector product with ones rather than a column of ones
        appended to the values: it reads the tile once more, from cache, which costs less.
        For ``Dv = 64`` on a 512 x 512 float32 tile (AMD EPYC Zen 4, one core): 65 columns
        took 1.18 times as long as 64, 72 (padded to BLAS's panel width) 1.13 times, and
        ``p @ 1`` adds 0.05; NumPy's ``p.sum(axis=1)`` would add 0.14. Values near the
        dtype's largest number may overflow here, silently: the face finds it in the result
        (:mod:`sdpa.tiles.ranges`).
        """
        n, keys = values.shape[0], p.shape[-1]
        rows = p.size // keys
        flat = (self.space.tile_out if out is None else out.reshape(-1))[: rows * self.Dv]
        if values.ndim > 3:  # batched as p is
            return np.matmul(p, values, out=flat.reshape(*p.shape[:-1], self.Dv))
        out = flat.reshape(n, rows // n, self.Dv)
        np.matmul(p.reshape(n, rows // n, keys), values, out=out)
        return out

    def sums_hold(self, run: slice = ALL, among: np.ndarray | None = None, parts: int = 1) -> bool:
        """Whether a unit started at zero may keep it: every row has ``l >= LAZY_FLOOR`` (NaN
        fails too); with ``run``, only those rows of each group, and with ``among`` (bools
        over the rows of a group) only those (the rows that meet an allowed key at all); with
        ``parts``, the rows ``run`` of each part. Checked after the first piece, for the rows
        it allowed some key, and at the end."""
        l = self.state(run, parts)[1]
        if among is not None:
            l = l[:, among]
        return l.size == 0 or bool(l.min() >= LAZY_FLOOR)

    def finish(self, out: np.ndarray, sinks: np.ndarray | None = None):
        """Write ``acc / l`` into ``out`` (any shape holding the unit's rows in order, last
        axis ``Dv``) and return ``(lse, m, l)`` ``(rows,)`` in natural units: ``lse = m +
        log l``, ``-inf`` where no score was allowed (``out`` 0 there), NaN where ``l`` is.

        With ``sinks`` ``(rows,)``, each row's sink joins its normaliser first
        (:func:`add_sinks`); the returned ``m`` and ``l`` then include it.
        """
        self.zero_fresh()  # a unit no step added to: out 0
        m = self.m / LOG2E if self.base2 else self.m  # in natural units
        l, alpha = self.l, 1
        if sinks is not None:
            m, l, alpha = add_sinks(m, l, sinks)
        if l.all():  # no empty row (NaN is not empty: it stays NaN), the common case
            inv, lse = alpha / l, np.log(l)
            lse += m
        else:
            empty = l == 0
            inv = np.zeros(self.rows, dtype=l.dtype)
            np.divide(alpha, l, out=inv, where=~empty)
            lse = np.full(self.rows, -np.inf, dtype=l.dtype)
            np.log(l, out=lse, where=~empty)
            np.add(lse, m, out=lse, where=~empty)
        np.multiply(self.acc.reshape(out.shape), inv.reshape(*out.shape[:-1], 1), out=out)
        return lse, m, l


def add_sinks(m: np.ndarray, l: np.ndarray, s: np.ndarray):
    """``(m, l, alpha)``: rows with each row's sink ``s`` added to its normaliser.

    ``m`` (the shift, in natural units), ``l`` (the sum of ``exp(score - m)``) and ``s`` are
    ``(rows,)``. The sink joins the shift, ``m_new = max(m, s)``, so that ``exp(s - m_new)``
    cannot overflow however far the lazy shift lags behind it; the keys' sums are rescaled by
    ``alpha = exp(m - m_new)``: ``l_new = alpha l + exp(s - m_new)`` and the output is
    ``alpha acc / l_new``. A row that met no allowed key (``l = 0``) gets ``m_new = s`` and
    ``l_new = 1`` (so ``lse = s`` exactly), or stays empty if its sink is ``-inf`` too. With
    ``s = -inf`` a row keeps its ``m`` and ``l`` bit for bit, and ``alpha = 1``.
    """
    seen = l > 0
    m_new = np.where(seen, np.maximum(m, s), s)
    shift = np.where(m_new > -np.inf, m_new, 0).astype(m.dtype, copy=False)
    alpha = np.zeros_like(l)
    np.exp(m - shift, out=alpha, where=seen)  # <= 1, and exactly 1 where the sink is below m
    l_new = l * alpha + np.exp(s - shift)  # exp(-inf) = 0 for a sink of -inf
    return m_new, l_new, alpha
