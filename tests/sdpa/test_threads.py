"""Worker threads and BLAS's thread count (src/sdpa/threads.py), from any calling thread.

The tiled paths hold BLAS to one thread while their workers run. That setting belongs to the
whole process, and threadpoolctl (3.8) lets only one thread change a pthreads OpenBLAS: these
tests call from thread pools, not only from the main thread, and check BLAS's thread count
inside the workers, the setting left behind, and that every caller gets the same bits.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sdpa import scaled_dot_product_attention
from sdpa.threads import run_in_threads, single_threaded_blas


def blas_threads() -> list[int]:
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


@pytest.fixture
def two_blas_threads():
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=2, user_api="blas"):
        if not blas_threads() or min(blas_threads()) < 2:
            pytest.skip("BLAS cannot run 2 threads here")
        yield blas_threads()


def in_thread(fn):
    """``fn()`` run in a new thread (not the main one); its result."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def test_a_block_entered_from_another_thread_limits_blas(two_blas_threads):
    # The main thread changes BLAS first (as it does in any program that called the tiled path
    # before starting threads); a block entered from a worker thread must still take effect.
    with single_threaded_blas():
        assert set(blas_threads()) == {1}
    assert blas_threads() == two_blas_threads

    def inside() -> tuple[list[int], list[int]]:
        with single_threaded_blas():
            during = blas_threads()
        return during, blas_threads()

    during, after = in_thread(inside)
    assert set(during) == {1}
    assert after == two_blas_threads


def test_first_and_last_holders_in_different_threads_restore_blas(two_blas_threads):
    # The main thread limits BLAS, a worker's block starts before the main thread's ends and
    # ends after it: the worker restores the setting the main thread saved.
    entered, main_left = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with single_threaded_blas():
            entered.set()
            main_left.wait(10)
            seen["during"] = blas_threads()
        seen["after"] = blas_threads()

    with single_threaded_blas():
        thread = threading.Thread(target=worker)
        thread.start()
        assert entered.wait(10)
    main_left.set()
    thread.join(10)
    assert set(seen["during"]) == {1}  # the worker's block still runs
    assert seen["after"] == two_blas_threads
    assert blas_threads() == two_blas_threads


def test_overlapping_blocks_first_finishing_first_restore_blas(two_blas_threads):
    # Each block restoring what it saw on entry would leave BLAS at one thread here.
    first, second = single_threaded_blas(), single_threaded_blas()
    first.__enter__()
    assert set(blas_threads()) == {1}
    second.__enter__()
    first.__exit__(None, None, None)
    assert set(blas_threads()) == {1}  # the second block still runs
    second.__exit__(None, None, None)
    assert blas_threads() == two_blas_threads


def test_workers_run_single_threaded_blas_from_a_thread_pool(two_blas_threads):
    # run_in_threads called from pool threads (and nested in its own workers): every task
    # sees BLAS at one thread.
    def probe():
        return blas_threads()

    def nested():
        return run_in_threads([probe, probe])

    with ThreadPoolExecutor(max_workers=4) as pool:
        flat = [pool.submit(run_in_threads, [probe, probe]) for _ in range(8)]
        deep = [pool.submit(run_in_threads, [nested]) for _ in range(4)]
        seen = [r for f in flat for r in f.result()]
        seen += [r for f in deep for inner in f.result() for r in inner]
    assert len(seen) == 8 * 2 + 4 * 2
    assert all(set(r) == {1} for r in seen)
    assert blas_threads() == two_blas_threads


@pytest.mark.parametrize("is_causal", [False, True])
def test_tiled_calls_from_threads_equal_a_serial_call_bitwise(two_blas_threads, is_causal):
    # Overlapping tiled calls from a pool (in float32, where sgemm's rounding depends on the
    # number of BLAS threads) give exactly the main thread's bits, and leave BLAS as it was.
    rng = np.random.default_rng(7)
    q = rng.standard_normal((3, 600, 32)).astype(np.float32)
    k = rng.standard_normal((3, 700, 32)).astype(np.float32)
    v = rng.standard_normal((3, 700, 24)).astype(np.float32)

    def call():
        return scaled_dot_product_attention(q, k, v, is_causal=is_causal, implementation="tiled")

    want = call()
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = [f.result() for f in [pool.submit(call) for _ in range(18)]]
    for got in results:
        np.testing.assert_array_equal(got, want)
    assert blas_threads() == two_blas_threads


def test_tasks_errors_are_raised_after_all_finish():
    done = []

    def fails():
        raise RuntimeError("task failed")

    def slow():
        threading.Event().wait(0.05)
        done.append(True)

    with pytest.raises(RuntimeError, match="task failed"):
        run_in_threads([fails, slow])
    assert done == [True]
