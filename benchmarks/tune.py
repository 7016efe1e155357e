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
    """(lead, T, S, d, causal, kv_heads) cases spanning many small heads to few large ones
    (T = S), and decoding: one query or a few against a long cache, at batch 1 with 8 to 64
    heads, also grouped (``enable_gqa``: 32 or 64 query heads over 8 key heads, T = 1 to 8)."""
    cases = []
    for lead in [(1,), (4,), (16,), (64,), (256,), (1024,), (4096,), (20000,)]:
        for n in (4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            scores = int(np.prod(lead)) * n * n
            if not (2**15 <= scores <= 2**24):
                continue
            for d in (8, 64) if n >= 16 else (8,):
                cases.append((lead, n, n, d, False, None))
            if n >= 256:
                cases.append((lead, n, n, 64, True, None))
    for heads in (8, 32, 64):
        for T in (1, 4, 16, 64):
            for S in (512, 2048, 8192, 16384):
                if heads * T * S <= 2**24:
                    cases.append(((1, heads), T, S, 64, False, None))
    for heads in (32, 64):
        for T in (1, 2, 4, 8):
            for S in (512, 2048, 4096, 16384):
                cases.append(((1, heads), T, S, 64, False, 8))
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


def _features(problem):
    """The terms of ``sdpa.cost_model.estimated_times``, per path, for one problem: the model
    itself, with one constant at 1 and the others at 0 (so the fit follows its geometry, GQA's
    shared key reads included)."""
    from sdpa.cost_model import REFERENCE_COST, TILED_COST, estimated_times

    def one_hot(costs, key):
        return {k: float(k == key) for k in costs}

    zero_ref, zero_til = one_hot(REFERENCE_COST, None), one_hot(TILED_COST, None)
    reference = [
        estimated_times(problem, reference_cost=one_hot(REFERENCE_COST, k), tiled_cost=zero_til)[0]
        for k in REFERENCE_COST
    ]
    tiled = [
        estimated_times(problem, reference_cost=zero_ref, tiled_cost=one_hot(TILED_COST, k))[1]
        for k in TILED_COST
    ]
    return reference, tiled


def auto(rounds=5, dtype=np.float32, idle=0.15):
    """Fit the cost model of ``implementation="auto"`` to wall times measured as `make bench`
    measures them.

    Both paths run as a user calls them (all cores, BLAS's own threads for the reference path,
    the tiled path's workers), taking turns round after round with ``idle`` seconds before
    each call (the benchmark's pause), and each keeps its best round. The model is linear in
    its constants: for the reference path a cost per call, per ``(T, S)`` matrix, per input
    entry read (packed keys, and those a GQA group shares, weighted as the model weighs them),
    per score, per score and unit of width, per masked score; for the tiled path a cost per
    call, per work unit and per further tile (Python between NumPy's calls, which holds the
    GIL: not shared by the workers) and per computed score, per score and unit of width and per
    key and value entry a tile reads (inside NumPy, shared by the workers). The grid includes
    grouped-query decoding (32 and 64 query heads over 8 key heads, T = 1 to 8). Least squares on relative errors, constants
    kept non-negative. Wall time moves with the machine and its load: run it on an idle
    machine, and state which.
    """
    from sdpa.attention import attention_reference
    from sdpa.cost_model import REFERENCE_COST, TILED_COST, estimated_times
    from sdpa.tiled import attention_tiled

    rows = []
    for lead, T, n, d, is_causal, kv_heads in auto_grid():
        kv_lead = lead if kv_heads is None else (*lead[:-1], kv_heads)
        q = rng.standard_normal((*lead, T, d)).astype(dtype)
        k, v = (rng.standard_normal((*kv_lead, n, d)).astype(dtype) for _ in range(2))
        gqa = kv_heads is not None
        problem = prepare_attention(q, k, v, None, is_causal, enable_gqa=gqa)
        paths = {
            "reference": lambda p=problem: attention_reference(p),
            "tiled": lambda p=problem: attention_tiled(p),
        }
        best = {name: np.inf for name in paths}
        for f in paths.values():
            f()
        for r in range(rounds):
            for name in list(paths) if r % 2 == 0 else list(paths)[::-1]:
                time.sleep(idle)
                start = time.perf_counter()
                paths[name]()
                best[name] = min(best[name], time.perf_counter() - start)
        ref_x, til_x = _features(problem)
        rows.append(
            dict(
                lead=lead if kv_heads is None else f"{lead}/{kv_heads}",
                T=T,
                n=n,
                d=d,
                causal=is_causal,
                problem=problem,
                ref_x=ref_x,
                tiled_x=til_x,
                ref=1e6 * best["reference"],
                tiled=1e6 * best["tiled"],
            )
        )
        print(
            f"{str(lead):9} kv={kv_heads!s:4} T={T:5} S={n:5} d={d:3} causal={is_causal!s:5}: wall reference "
            f"{best['reference'] * 1e3:9.2f} ms, tiled {best['tiled'] * 1e3:9.2f} ms",
            flush=True,
        )

    def fit(key, names):
        A = np.array([r[key + "_x"] for r in rows], dtype=float)
        b = np.array([r[key] for r in rows])
        x = _nnls(A / b[:, None], np.ones(len(rows)))
        spread = A @ x / b
        low, mid, high = np.percentile(spread, [10, 50, 90])
        print(f"{key}: model / measured: median {mid:.2f}, 10 % to 90 %: {low:.2f} to {high:.2f}")
        return dict(zip(names, (float(f"{c:.3g}") for c in x)))

    fitted_ref = fit("ref", list(REFERENCE_COST))
    fitted_til = fit("tiled", list(TILED_COST))
    print("REFERENCE_COST =", fitted_ref)
    print("TILED_COST =", fitted_til)

    def picks(model_ref, model_til):
        times = (
            estimated_times(row["problem"], reference_cost=model_ref, tiled_cost=model_til)
            for row in rows
        )
        return ["tiled" if t < r else "reference" for r, t in times]

    worst = {}
    for label, model in (
        ("fitted", (fitted_ref, fitted_til)),
        ("current", (REFERENCE_COST, TILED_COST)),
    ):
        chosen = picks(*model)
        ratios = [
            row[{"reference": "ref", "tiled": "tiled"}[c]] / min(row["ref"], row["tiled"])
            for row, c in zip(rows, chosen)
        ]
        worst[label] = max(ratios)
        for row, c, ratio in zip(rows, chosen, ratios):
            if ratio > 1.1:
                print(
                    f"  {label} model: {row['lead']} T={row['T']} S={row['n']} "
                    f"d={row['d']} causal={row['causal']}: takes {c}, {ratio:.2f} x the faster"
                )
    print("worst chosen/faster:", {k: round(v, 2) for k, v in worst.items()})


if __name__ == "__main__":
    what = sys.argv[1:] or ["tiles", "threshold", "auto"]
    if "tiles" in what:
        tiles()
    if "threshold" in what:
        threshold()
    if "auto" in what:
        auto()
