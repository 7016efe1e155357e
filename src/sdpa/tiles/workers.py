"""The worker threads of a tiled call: sharing its units out, one failure policy, counters.

A call lists its units; ``run_units()`` starts up to ``num_threads`` workers (threads
started for the call, :func:`sdpa.threads.run_in_threads`), each taking the next unit from the
shared list until none is left. NumPy releases the GIL inside matrix products and ufunc loops,
so the threads run in parallel; BLAS is held to one thread, since its own threading
parallelises each small product badly. What a unit computes depends on its inputs alone, so the
bits of the result do not depend on the threads. When a unit raises, the other workers take no
further unit and the first error reaches the caller.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import numpy as np

from ..threads import run_in_threads, single_threaded_blas

__all__: list[str] = []


class Counts:
    """A mixin for the dataclasses of counters the faces fill (``TileStats``, ``FlexStats``)."""

    def add(self, other) -> None:
        """Add the counts of ``other`` to these.

        Parameters
        ----------
        other
            Counts of the same class (for example one worker thread's).
        """
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def run_units(units: Sequence[tuple], workers: Sequence, stats=None) -> None:
    """Run ``worker.run(*unit)`` for every unit, the workers taking them in turn from the list.

    Each worker has ``run``, ``stats`` (a :class:`Counts`, added to ``stats`` at the end) and
    ``space`` (a :class:`sdpa.tiles.softmax.Workspace`, released at the end, even on failure).
    Floating-point errors are silenced inside the units: the engine's arithmetic with
    ``-inf`` is deliberate (``exp(-inf) = 0``, ``m - m_new = -inf``), overflow is excluded up
    front or checked by the faces, and values out of range are found in the result.
    """
    counter = itertools.count()
    failed: list[bool] = []  # set by a worker whose unit raised: the others stop taking units

    def drain(worker) -> None:
        try:
            with np.errstate(all="ignore"):
                while not failed:
                    i = next(counter)
                    if i >= len(units):
                        return
                    worker.run(*units[i])
        except BaseException:
            failed.append(True)
            raise

    try:
        if len(workers) == 1:
            with single_threaded_blas():  # BLAS's threads slow small products down, here too
                drain(workers[0])
        else:
            run_in_threads([functools.partial(drain, w) for w in workers])
    finally:  # every thread has finished: their scratch buffers serve the next call
        for w in workers:
            w.space.release()
    if stats is not None:
        for w in workers:
            stats.add(w.stats)


def column_top(workers: Sequence) -> np.ndarray:
    """The largest ``|out|`` of each value column over the workers' units (NaN if any was)."""
    return functools.reduce(np.maximum, [w.space.top for w in workers])
