"""Worker threads with BLAS held to one thread: the one threading scheme of the tiled paths.

The tiled forward (:func:`sdpa.tiled.attention_tiled`) and the tiled backward
(:func:`sdpa.scaled_dot_product_attention_backward`) share their work among threads of this
process. NumPy releases the GIL inside matrix products and ufunc loops, so the threads run in
parallel; BLAS's own threads would parallelise each small product badly, so
:func:`run_in_threads` holds BLAS to one thread while they run (with ``threadpoolctl``). Both
paths call their thread count ``num_threads`` and default to :func:`default_num_threads`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

__all__ = ["default_num_threads", "run_in_threads", "single_threaded_blas"]


def default_num_threads() -> int:
    """The number of cores this process may run on: the tiled paths' default thread count.

    Returns
    -------
    int
        ``len(os.sched_getaffinity(0))`` where available, else ``os.cpu_count()``, at least 1.

    Examples
    --------
    >>> from sdpa.threads import default_num_threads
    >>> default_num_threads() >= 1
    True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class _BlasLimit:
    """BLAS held to one thread while any caller, in any thread, is inside a block.

    BLAS's thread count is a setting of the whole process, so this is one object per process
    (``_BLAS``): a count of the blocks open, the limiter of the first (which saved the setting)
    and a lock. threadpoolctl (from 3.8) lets only one "controlling" thread change an OpenBLAS
    built with pthreads and silently ignores the others, so each change made here takes
    control for itself and gives it up at once: the first block and the last may be in
    different threads.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.holders = 0  # blocks open, in any thread
        self.limiter = None  # threadpoolctl's limiter of the first; restored by the last
        self.controller = None  # inspecting the libraries is slow: once, on first use

    def enter(self) -> None:
        with self.lock:
            if self.holders == 0:
                self.limiter = self.change(lambda c: c.limit(limits=1, user_api="blas"))
            self.holders += 1

    def leave(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0 and self.limiter is not None:
                self.change(lambda c: self.limiter.restore_original_limits())
                self.limiter = None

    def change(self, change: Callable):
        """``change(controller)`` as the thread that controls BLAS's settings, whichever this
        is: control is released before (whoever held it last) and after, so the next change,
        from any thread, takes effect. Called under the lock."""
        from threadpoolctl import ThreadpoolController

        if self.controller is None:
            self.controller = ThreadpoolController()
        release = _release_blas_control()
        release()
        try:
            return change(self.controller)
        finally:
            release()


_BLAS = _BlasLimit()


def _release_blas_control() -> Callable[[], None]:
    """A function that makes no thread the controller of OpenBLAS (a no-op before 3.8)."""
    import threadpoolctl

    openblas = getattr(threadpoolctl, "OpenBLASController", None)
    clear = getattr(openblas, "clear_controlling_thread", None)
    return (lambda: clear(force=True)) if clear is not None else (lambda: None)


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Hold BLAS to one thread for the duration of a ``with`` block, from any thread.

    BLAS's thread count is a setting of the whole process, so overlapping blocks in several
    threads share one limit: the first to enter saves the setting and limits it, the last to
    leave restores it, whichever threads they are. (Each block restoring what it saw on entry
    would leave BLAS at one thread whenever two blocks overlap and the first finishes first.)

    Yields
    ------
    None

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.threads import single_threaded_blas
    >>> with single_threaded_blas():
    ...     x = np.ones((64, 64)) @ np.ones((64, 64))
    >>> float(x[0, 0])
    64.0
    """
    _BLAS.enter()
    try:
        yield
    finally:
        _BLAS.leave()


def run_in_threads(tasks: list[Callable[[], object]]) -> list:
    """Run each callable in a thread of its own, with BLAS held to one thread.

    The threads are created for the call rather than kept in a pool. Measured on the 2-core
    benchmark machine, a pool's idle threads, woken together by the calling thread, often
    shared one core for the first tens of milliseconds (Linux wakes a thread near its waker
    and balances the load only later), so a 20 ms problem took 30 to 35 ms; new threads are
    placed on idle cores at once, and creating them costs well under a millisecond.

    Parameters
    ----------
    tasks : list of callable
        Functions of no argument.

    Returns
    -------
    list
        Their results, in the order of ``tasks``. The first exception raised by a task is
        raised again here, after every task has finished.

    Examples
    --------
    >>> from sdpa.threads import run_in_threads
    >>> run_in_threads([lambda: 1, lambda: 2])
    [1, 2]
    """
    with single_threaded_blas(), ThreadPoolExecutor(max_workers=max(1, len(tasks))) as pool:
        futures = [pool.submit(task) for task in tasks]
        return [f.result() for f in futures]
