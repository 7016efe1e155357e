"""Measurements behind the constants of ``sdpa.tiled``: tile sizes and the ``auto`` rule.

``.venv/bin/python benchmarks/tune.py [tiles|threshold|auto]``

* ``tiles``: CPU time of one worker thread (``time.thread_time``, BLAS on one thread) for a
  grid of tile sizes at n = 2048, one head of width 64, causal and not. CPU time of a single
  thread is far less sensitive to other processes on a shared machine than wall time.
  Configurations are interleaved round after round; the table shows the best round of each,
  relative to the current default.
* ``threshold``: wall time of ``implementation="reference"`` and ``"tiled"`` (all cores)
  interleaved, for small problems, to place ``sdpa.cost_model.MIN_TILED_SCORES``.
* ``auto``: wall time of both paths, interleaved (best of several rounds, which is the least
  disturbed by other processes), over a grid of head counts, lengths and widths; then a
  least-squares fit of the cost model of ``sdpa.cost_model.estimated_times`` (relative errors,
  coefficients kept non-negative). Prints the fitted ``REFERENCE_COST`` and ``TILED_COST`` and,
  for each case, which path the fitted and the current models choose and what that costs.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

import sdpa
from sdpa import tiled, tuning
from sdpa.problem import prepare_attention

rng = np.random.default_rng(0)


def tiles(n=2048, rounds=3):
    grid = {
        np.float32: [(128, 256), (128, 512), (256, 256), (256, 512), (512, 512), (256, 1024)],
        np.float64: [(64, 512), (128, 256), (128, 512), (256, 256), (256, 512), (512, 256)],
    }
    for dtype, configs in grid.items():
        for is_causal in (False, True):
            rows = tuning.BLOCK_ROWS if is_causal else tuning.BLOCK_ROWS_FULL  # the defaults
            default = (rows[np.dtype(dtype)], tuning.BLOCK_K[np.dtype(dtype)])
            q, k, v = (rng.standard_normal((n, 64)).astype(dtype) for _ in range(3))
            problem = prepare_attention(q, k, v, None, is_causal)
            best = {c: np.inf for c in configs}
            with threadpool_limits(1, user_api="blas"):
                for _ in range(rounds):
                    for c in configs:
                        start = time.thread_time()
                        tiled.attention_tiled(problem, block_q=c[0], block_k=c[1], num_threads=1)
                        best[c] = min(best[c], time.thread_time() - start)
            ref = best.get(default, min(best.values()))
            print(
                f"{np.dtype(dtype).name} causal={is_causal}: "
                + "  ".join(f"{c[0]}x{c[1]} {best[c] / ref:.2f}" for c in configs),
                flush=True,
            )


def threshold(rounds=7, idle=0.05):
    cases = [(h, n) for h in (1, 8) for n in (64, 128, 256, 384, 512, 768, 1024)]
    for h, n in cases:
        q, k, v = (rng.standard_normal((h, n, 64)).astype(np.float32) for _ in range(3))
        times = {"reference": [], "tiled": []}
        for _ in range(rounds):
            for impl in times:
                time.sleep(idle)
                start = time.perf_counter()
                sdpa.scaled_dot_product_attention(q, k, v, implementation=impl)
                times[impl].append(time.perf_counter() - start)
        ref, til = (float(np.median(times[i])) for i in ("reference", "tiled"))
        print(
            f"H={h} n={n:5} scores={h * n * n:9}: reference {ref * 1e3:7.2f} ms, "
            f"tiled {til * 1e3:7.2f} ms, tiled/reference {til / ref:.2f}",
            flush=True,
        )


def auto_grid():
    """(lead, n, d, causal) cases spanning many small heads to few large ones."""
    cases = []
    for lead in [(1,), (4,), (16,), (64,), (256,), (1024,), (4096,), (20000,)]:
        for n in (4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            scores = int(np.prod(lead)) * n * n
            if not (2**15 <= scores <= 2**24):
                continue
            for d in (8, 64) if n >= 16 else (8,):
                cases.append((lead, n, d, False))
            if n >= 256:
                cases.append((lead, n, 64, True))
    return cases


def _nnls(A, b, iterations=20):
    """Least squares with non-negative coefficients: refit without those that come out negative."""
    free = np.ones(A.shape[1], dtype=bool)
    x = np.zeros(A.shape[1])
    for _ in range(iterations):
        x[:] = 0
        x[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
        if (x >= 0).all():
            break
        free &= x > 0
    return x


def _cpu_time(f, rounds):
    """Best CPU time of ``f`` on the calling thread over ``rounds`` runs (after a warm-up)."""
    f()
    best = np.inf
    for _ in range(rounds):
        start = time.thread_time()
        f()
        best = min(best, time.thread_time() - start)
    return best


def _wall_time(f, rounds, idle=0.01):
    f()
    best = np.inf
    for _ in range(rounds):
        time.sleep(idle)
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def auto(rounds=5, dtype=np.float32):
    """Fit the cost model of ``implementation="auto"`` from single-thread CPU times.

    CPU time of one thread barely moves when other processes share the machine, where wall
    time can change tenfold; so both paths run on one thread (BLAS held to one thread, the
    tiled path with ``num_threads=1``), their CPU costs are fitted term by term, and the wall time
    on ``W`` idle cores is modelled from them: the tiled path divides its work among the
    workers; the reference path's products (the term proportional to the head width) run on
    BLAS's threads, its softmax passes on one. The fixed cost of a call (validation, and for
    the tiled path the creation of its threads) is the best wall time of a tiny problem.
    """
    from sdpa.attention import attention_reference
    from sdpa.cost_model import REFERENCE_COST, TILED_COST, estimated_times, tiling_geometry
    from sdpa.threads import default_num_threads
    from sdpa.tiled import attention_tiled

    workers = default_num_threads()
    rows = []
    with threadpool_limits(1, user_api="blas"):
        for lead, n, d, is_causal in auto_grid():
            q, k, v = (rng.standard_normal((*lead, n, d)).astype(dtype) for _ in range(3))
            problem = prepare_attention(q, k, v, None, is_causal)
            ref = 1e6 * _cpu_time(lambda p=problem: attention_reference(p), rounds)
            til = 1e6 * _cpu_time(lambda p=problem: attention_tiled(p, num_threads=1), rounds)
            units, tiles_, scores, _ = tiling_geometry(problem)
            matrices = int(np.prod(problem.batch_shape))
            rows.append(
                dict(
                    lead=lead,
                    n=n,
                    d=d,
                    causal=is_causal,
                    ref=ref,
                    tiled=til,
                    matrices=matrices,
                    units=units,
                    tiles=tiles_,
                    scores=scores,
                    width=2 * d,
                    problem=problem,
                )
            )
            print(
                f"{str(lead):9} n={n:5} d={d:3} causal={is_causal!s:5}: CPU reference "
                f"{ref / 1e3:9.2f} ms, tiled {til / 1e3:9.2f} ms",
                flush=True,
            )
    tiny = np.zeros((1, 8, 8), dtype)
    call_ref = 1e6 * _wall_time(
        lambda: sdpa.scaled_dot_product_attention(tiny, tiny, tiny, implementation="reference"), 50
    )
    call_til = 1e6 * _wall_time(
        lambda: sdpa.scaled_dot_product_attention(tiny, tiny, tiny, implementation="tiled"), 50
    )

    # CPU of the reference path, per matrix: matrix + io * (T + S) * width; per score:
    # score + score_width * width + masked * (a mask or band)
    A = np.array(
        [
            [
                r["matrices"],
                r["matrices"] * 2 * r["n"] * r["width"],
                r["matrices"] * r["n"] ** 2,
                r["matrices"] * r["n"] ** 2 * r["width"],
                r["matrices"] * r["n"] ** 2 * r["causal"],
            ]
            for r in rows
        ],
        dtype=float,
    )
    b = np.array([r["ref"] for r in rows])
    x_ref = _nnls(A / b[:, None], np.ones(len(rows)))
    spread_ref = A @ x_ref / b
    matrix, io, score, width, masked = x_ref
    fitted_ref = dict(
        call=call_ref, matrix=matrix, io=io, score=score, score_width=width / workers, masked=masked
    )  # BLAS spreads the products
    # CPU of the tiled path = unit * units + tile * (tiles - units)
    #                         + computed * (score + score_width * width)
    A = np.array(
        [
            [r["units"], r["tiles"] - r["units"], r["scores"], r["scores"] * r["width"]]
            for r in rows
        ],
        dtype=float,
    )
    b = np.array([r["tiled"] for r in rows])
    x_til = _nnls(A / b[:, None], np.ones(len(rows)))
    spread_til = A @ x_til / b
    unit, tile, score, width = x_til
    fitted_til = dict(call=call_til, unit=unit, tile=tile, score=score, score_width=width)
    print("REFERENCE_COST =", {k: float(f"{v:.3g}") for k, v in fitted_ref.items()})
    print("TILED_COST =", {k: float(f"{v:.3g}") for k, v in fitted_til.items()})
    for name, spread in (("reference", spread_ref), ("tiled", spread_til)):
        low, mid, high = np.percentile(spread, [10, 50, 90])
        print(
            f"{name}: model / measured CPU time: median {mid:.2f}, 10 % to 90 %: "
            f"{low:.2f} to {high:.2f}"
        )

    # which path each model picks, by the modelled wall times
    def picks(model_ref, model_til):
        times = (
            estimated_times(row["problem"], reference_cost=model_ref, tiled_cost=model_til)
            for row in rows
        )
        return ["tiled" if t < r else "reference" for r, t in times]

    new_picks = picks(fitted_ref, fitted_til)
    old_picks = picks(REFERENCE_COST, TILED_COST)
    for row, new, old in zip(rows, new_picks, old_picks):
        print(
            f"  {str(row['lead']):9} n={row['n']:5} d={row['d']:3} causal={row['causal']!s:5}: "
            f"fitted model takes {new:9}, current model {old}"
        )


if __name__ == "__main__":
    what = sys.argv[1:] or ["tiles", "threshold", "auto"]
    if "tiles" in what:
        tiles()
    if "threshold" in what:
        threshold()
    if "auto" in what:
        auto()
