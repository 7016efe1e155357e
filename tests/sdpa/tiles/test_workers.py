"""The worker loop of the tiled paths (sdpa.tiles.workers): every unit run once whatever the
number of workers, the failure policy, the counters merged, the columns' largest ``|out|``.

The workers here are small stand-ins with the interface the faces' workers have (``run``,
``stats`` and ``space``, released at the end; ``space.top`` for :func:`column_top`), recording
what they were given.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from sdpa.tiles.workers import Counts, column_top, run_units


@dataclasses.dataclass
class Tally(Counts):
    units: int = 0
    keys: int = 0
    seconds: float = 0.0


class Space:
    """A worker's buffers: counts its releases."""

    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


class Recorder:
    """A worker that records its units (in a list shared by all) and counts them."""

    def __init__(self, ran: list, lock: threading.Lock, fail_at=None, pause=0.0):
        self.ran, self.lock, self.fail_at, self.pause = ran, lock, fail_at, pause
        self.stats = Tally()
        self.space = Space()

    def run(self, index: int, keys: int) -> None:
        if self.pause:
            time.sleep(self.pause)  # lets the other threads take units meanwhile
        with self.lock:
            self.ran.append(index)
        if index == self.fail_at:
            raise ValueError(f"unit {index} failed")
        self.stats.units += 1
        self.stats.keys += keys


def recorders(n, **kw):
    ran, lock = [], threading.Lock()
    return ran, [Recorder(ran, lock, **kw) for _ in range(n)]


@pytest.mark.parametrize("n_workers", [1, 2, 3, 4])
def test_every_unit_runs_exactly_once(n_workers):
    units = [(i, i % 7) for i in range(57)]
    ran, workers = recorders(n_workers, pause=1e-4)
    stats = Tally()
    run_units(units, workers, stats)
    assert sorted(ran) == list(range(57))
    assert stats.units == 57 and stats.keys == sum(k for _, k in units)
    assert sum(w.stats.units for w in workers) == 57  # each worker's own count is kept
    assert [w.space.released for w in workers] == [1] * n_workers


def test_no_units_and_no_stats():
    ran, workers = recorders(2)
    run_units([], workers)
    assert ran == []


def test_one_worker_stops_at_the_failing_unit():
    ran, workers = recorders(1, fail_at=4)
    stats = Tally()
    with pytest.raises(ValueError, match="unit 4 failed"):
        run_units([(i, 1) for i in range(20)], workers, stats)
    assert ran == [0, 1, 2, 3, 4]  # in order, and none after the failure
    assert workers[0].space.released == 1  # its buffers go back all the same


@pytest.mark.parametrize("n_workers", [2, 3, 4])
def test_a_failing_unit_stops_the_other_workers(n_workers):
    # Unit 0 raises once every other worker holds a unit (1 to n - 1); those wait until it
    # has raised, and 0.1 s more for its worker to record the failure: then none may take
    # another unit.
    raised, ran, lock = threading.Event(), [], threading.Lock()

    class Worker:
        stats = Tally()

        def __init__(self):
            self.space = Space()

        def run(self, index):
            with lock:
                ran.append(index)
            if index == 0:
                deadline = time.monotonic() + 10
                while len(ran) < n_workers and time.monotonic() < deadline:
                    time.sleep(1e-3)
                raised.set()
                raise ValueError("unit 0 failed")
            assert raised.wait(timeout=10)
            time.sleep(0.1)

    workers = [Worker() for _ in range(n_workers)]
    with pytest.raises(ValueError, match="unit 0 failed"):
        run_units([(i,) for i in range(50)], workers)
    assert sorted(ran) == list(range(n_workers))
    assert [w.space.released for w in workers] == [1] * n_workers  # only once all have stopped


def test_floating_point_errors_are_silenced_inside_units_only():
    before = np.geterr()
    seen = []

    class Overflowing:
        stats = Tally()
        space = Space()

        def run(self, x):
            seen.append(float(np.exp(np.float64(x))))  # would warn (an error under pytest)

    run_units([(1000.0,), (-np.inf,)], [Overflowing()])
    assert seen == [np.inf, 0.0]
    assert np.geterr() == before


def test_counts_add_field_by_field():
    a, b = Tally(units=2, keys=10, seconds=0.5), Tally(units=3, keys=1, seconds=0.25)
    a.add(b)
    assert a == Tally(units=5, keys=11, seconds=0.75)
    assert b == Tally(units=3, keys=1, seconds=0.25)  # the other is not touched


def test_column_top_is_the_largest_over_the_workers():
    def worker(*top):
        return SimpleNamespace(space=SimpleNamespace(top=np.array(top)))

    tops = [worker(1.0, 5.0, 0.0), worker(3.0, 2.0, np.nan), worker(0.5, 6.0, 1.0)]
    np.testing.assert_array_equal(column_top(tops), [3.0, 6.0, np.nan])
    np.testing.assert_array_equal(tops[0].space.top, [1.0, 5.0, 0.0])  # not widened in place
