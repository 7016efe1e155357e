"""Measurements behind the constants of ``sdpa.tiled``: tile sizes and the ``auto`` rule.

``.venv/bin/python benchmarks/tune.py [tiles|threshold|auto]``

* ``tiles``: CPU time of one worker thread (``time.thread_time``, BLAS on one thread) for a
  grid of tile sizes at n = 2048, one head of width 64, causal and not. CPU time of a single
  thread is far less sensitive to other processes on a shared machine than wall time.
  Configurations are interleaved round after round; the table shows the best round of each,
  relative to the current default.
* ``threshold``: wall time of ``implementation="reference"`` and ``"tiled"`` (all cores)
  interleaved, for small problems, to place ``sdpa.cost_model.MIN_TILED_SCORES``.
* ``auto``: wall time of both paths (the tiled path on all cores and on one thread),
  interleaved (best of several rounds, which is the least disturbed by other processes), over
  a grid of head counts, lengths and widths; then a least-squares fit of the cost model of
  ``sdpa.cost_model.estimated_times`` (relative errors, coefficients kept non-negative).
  Prints the fitted ``REFERENCE_COST`` and ``TILED_COST`` and, for each case where it costs
  more than 10 %, which path (and threads) the fitted and the current models choose.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import sdpa
from sdpa import tiled, tuning
from sdpa.problem import prepare_attention

rng = np.random.default_rng(0)


def tiles(n=2048, rounds=3):
    grid = {
        np.float32: [(256, 256), (256, 512), (512, 256), (512, 512), (1024, 256), (1024, 512)],
        np.float64: [(128, 256), (256, 256), (256, 512), (512, 256), (1024, 256), (1024, 512)],
    }
    for dtype, configs in grid.items():
        for is_causal in (False, True):
            keys = tuning.BLOCK_K_BAND if is_causal else tuning.BLOCK_K  # the defaults, one thread
            default = (tuning.BLOCK_ROWS_FULL[np.dtype(dtype)], keys[np.dtype(dtype)])
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


def _features(problem, num_threads=None):
    """The terms of ``sdpa.cost_model.estimated_times``, per path, for one problem (the tiled
    path's on ``num_threads``, default all cores): the model itself, with one constant at 1
    and the others at 0 (so the fit follows its geometry, GQA's shared key reads included)."""
    from sdpa.cost_model import REFERENCE_COST, TILED_COST, estimated_times

    def one_hot(costs, key):
        return {k: float(k == key) for k in costs}

    zero_ref, zero_til = one_hot(REFERENCE_COST, None), one_hot(TILED_COST, None)
    reference = [
        estimated_times(problem, reference_cost=one_hot(REFERENCE_COST, k), tiled_cost=zero_til)[0]
        for k in REFERENCE_COST
    ]
    tiled = [
        estimated_times(
            problem, reference_cost=zero_ref, tiled_cost=one_hot(TILED_COST, k),
            num_threads=num_threads,
        )[1]
        for k in TILED_COST
    ]  # fmt: skip
    return reference, tiled


def _problem(lead, T, n, d, is_causal, kv_heads, dtype=np.float32):
    """Random inputs of one grid case, prepared as the public call prepares them."""
    kv_lead = lead if kv_heads is None else (*lead[:-1], kv_heads)
    q = rng.standard_normal((*lead, T, d)).astype(dtype)
    k, v = (rng.standard_normal((*kv_lead, n, d)).astype(dtype) for _ in range(2))
    return prepare_attention(q, k, v, None, is_causal, enable_gqa=kv_heads is not None)


def measure_auto(rounds=5, dtype=np.float32, idle=0.15):
    """Wall times of both paths on ``auto_grid()``, as `make bench` measures them: the
    reference path as a user calls it, the tiled path on all cores and on one thread, taking
    turns round after round with ``idle`` seconds before each call, each keeping its best
    round (microseconds)."""
    from sdpa.attention import attention_reference
    from sdpa.threads import default_num_threads
    from sdpa.tiled import attention_tiled

    threads = default_num_threads()
    rows = []
    for lead, T, n, d, is_causal, kv_heads in auto_grid():
        problem = _problem(lead, T, n, d, is_causal, kv_heads, dtype)
        paths = {
            "ref": attention_reference,
            "tiled": lambda p: attention_tiled(p, num_threads=threads),
            "tiled1": lambda p: attention_tiled(p, num_threads=1),
        }
        best = {name: np.inf for name in paths}
        for f in paths.values():
            f(problem)
        for r in range(rounds):
            for name in list(paths) if r % 2 == 0 else list(paths)[::-1]:
                time.sleep(idle)
                start = time.perf_counter()
                paths[name](problem)
                best[name] = min(best[name], time.perf_counter() - start)
        row = dict(lead=list(lead), T=T, n=n, d=d, causal=is_causal, kv_heads=kv_heads)
        rows.append(row | {name: 1e6 * t for name, t in best.items()})
        print(
            f"{str(lead):9} kv={kv_heads!s:4} T={T:5} S={n:5} d={d:3} causal={is_causal!s:5}: "
            f"wall reference {best['ref'] * 1e3:9.2f} ms, tiled {best['tiled'] * 1e3:9.2f} ms "
            f"(one thread {best['tiled1'] * 1e3:9.2f} ms)",
            flush=True,
        )
    return rows


def load_rows(path):
    """Rows saved by ``auto --save``, or the ``auto`` grid of a `make bench` result (JSON)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return data
    return [
        dict(
            lead=case["lead"],
            T=case["t"],
            n=case["n"],
            d=case["d"],
            causal=case["causal"],
            kv_heads=case.get("kv_heads"),
            ref=1e6 * case["time"]["reference"],
            tiled=1e6 * case["time"]["tiled"],
            tiled1=None,  # the tiled path as a user calls it, on the threads the model picked
        )
        for case in data["auto"]
    ]


# The cache shares of a GQA group's further key reads (sdpa.cost_model.CACHED_READ and
# PACKED_READ), fitted beside the linear constants by the refinement.
SHARES = (("CACHED_READ", "within_cache"), ("CACHED_READ", "beyond_cache"))
SHARES += tuple(("PACKED_READ", key) for key in ("first", "within_cache", "beyond_cache"))


def _set_shares(values):
    from types import MappingProxyType

    from sdpa import cost_model

    for name in ("CACHED_READ", "PACKED_READ"):
        table = dict(getattr(cost_model, name))
        table.update({key: float(v) for (n, key), v in zip(SHARES, values) if n == name})
        setattr(cost_model, name, MappingProxyType(table))


def _estimates(row, model_ref, model_til):
    """``(reference, tiled, tiled1)``: the model's estimates for a row, the tiled path on all
    cores and on one thread."""
    from sdpa.cost_model import estimated_times

    pr, pt = estimated_times(row["problem"], reference_cost=model_ref, tiled_cost=model_til)
    p1 = estimated_times(
        row["problem"], reference_cost=model_ref, tiled_cost=model_til, num_threads=1
    )[1]
    return pr, pt, p1


def _measured(row) -> dict:
    """The row's measured paths: ``ref``, ``tiled`` and, where measured, ``tiled1``."""
    return {k: row[k] for k in ("ref", "tiled", "tiled1") if row.get(k) is not None}


def _choice(row, pr, pt, p1) -> str:
    """The path ``implementation="auto"`` takes with these estimates (as
    ``sdpa.cost_model.auto_path``, but with the one-thread estimate of its own geometry where
    the package reuses the all-cores geometry): ``ref``, ``tiled`` or ``tiled1``. The path is
    chosen against the tiled path on all cores, then the threads."""
    from sdpa.cost_model import MIN_TILED_SCORES

    if not (pt < pr and row["scores"] >= MIN_TILED_SCORES):
        return "ref"
    return "tiled1" if p1 <= pt and "tiled1" in _measured(row) else "tiled"


def _decision_loss(rows, names_ref, names_til, z):
    """Mean squared log error of the estimates, plus, for each case whose paths differ by
    more than 5 %, a smooth penalty when the model prefers the slower of two (the reference
    path against the tiled path on all cores, and the tiled path's two thread counts),
    weighted by how much slower it is (cases below ``MIN_TILED_SCORES`` never tile, and do
    not count in the first)."""
    from sdpa.cost_model import MIN_TILED_SCORES

    c = np.exp(z)
    _set_shares(c[len(names_ref) + len(names_til) :])
    model_ref = dict(zip(names_ref, c[: len(names_ref)]))
    model_til = dict(zip(names_til, c[len(names_ref) : len(names_ref) + len(names_til)]))
    loss = 0.0
    for row in rows:
        pr, pt, p1 = _estimates(row, model_ref, model_til)
        measured = _measured(row)
        loss += 0.05 * (np.log(pr / row["ref"]) ** 2 + np.log(pt / row["tiled"]) ** 2)
        pairs = []  # (measured log ratio a / b, the model's)
        if "tiled1" in measured:
            loss += 0.05 * np.log(p1 / row["tiled1"]) ** 2
            pairs.append((np.log(row["tiled1"] / row["tiled"]), np.log(p1 / pt)))
        if row["scores"] >= MIN_TILED_SCORES:
            pairs.append((np.log(row["ref"] / row["tiled"]), np.log(pr / pt)))
        for gap, estimate in pairs:  # gap > 0: the second is the faster
            if abs(gap) > 0.05:
                loss += abs(gap) * np.logaddexp(0, -8 * np.sign(gap) * estimate) / 8
    return loss / len(rows)


def _refine(loss, z, step=0.5, rounds=200):
    """Coordinate descent in log space: each constant times exp(+-step) while that lowers the
    loss; the step halves when no constant moves, down to 1 %."""
    best = loss(z)
    for _ in range(rounds):
        moved = False
        for i in range(len(z)):
            for sign in (1, -1):
                trial = z.copy()
                trial[i] += sign * step
                value = loss(trial)
                if value < best - 1e-12:
                    z, best, moved = trial, value, True
                    break
        if not moved:
            step /= 2
            if step < 0.01:
                break
    return z


def auto(rows):
    """Fit the cost model of ``implementation="auto"`` to measured wall times ``rows``.

    The model is linear in its constants: for the reference path a cost per call, per
    ``(T, S)`` matrix, per input entry read (packed keys, and those a GQA group shares,
    weighted by the cache shares), per score, per score and unit of width, per masked score;
    for the tiled path a cost per call, per work unit and per further step (Python between
    NumPy's calls, which holds the GIL: not shared by the workers) and per computed score, per
    score and unit of width and per key and value entry a tile reads (inside NumPy, shared by
    the workers). First a least-squares fit on relative errors, constants kept non-negative;
    then a refinement of the constants and of the cache shares that also penalises each case
    where the model would choose the slower path (`make bench` judges the choices). Wall time
    moves with the machine and its load: measure on an idle machine, and state which.
    """
    from sdpa import cost_model
    from sdpa.cost_model import REFERENCE_COST, TILED_COST

    for row in rows:
        row["problem"] = _problem(
            tuple(row["lead"]), row["T"], row["n"], row["d"], row["causal"], row["kv_heads"]
        )
        row["scores"] = int(np.prod(row["lead"])) * row["T"] * row["n"]
        row["ref_x"], row["tiled_x"] = _features(row["problem"])
        if row.get("tiled1") is not None:
            row["tiled1_x"] = _features(row["problem"], num_threads=1)[1]

    def fit(*keys):  # the rows' observations of these paths, one set of constants
        seen = [(r[key + "_x"], r[key]) for r in rows for key in keys if r.get(key) is not None]
        A = np.array([x for x, _ in seen], dtype=float)
        b = np.array([t for _, t in seen])
        return _nnls(A / b[:, None], np.ones(len(seen)))

    names_ref, names_til = list(REFERENCE_COST), list(TILED_COST)
    linear = np.concatenate([fit("ref"), fit("tiled", "tiled1")])
    shares = [getattr(cost_model, name)[key] for name, key in SHARES]
    current = {name: getattr(cost_model, name) for name in ("CACHED_READ", "PACKED_READ")}
    z = np.log(np.concatenate([np.maximum(linear, 1e-9), shares]))
    z = _refine(lambda z: _decision_loss(rows, names_ref, names_til, z), z)
    c = np.exp(z)
    fitted_ref = {k: float(f"{v:.3g}") for k, v in zip(names_ref, c)}
    fitted_til = {k: float(f"{v:.3g}") for k, v in zip(names_til, c[len(names_ref) :])}
    fitted_shares = [float(f"{v:.3g}") for v in c[len(names_ref) + len(names_til) :]]
    print("REFERENCE_COST =", fitted_ref)
    print("TILED_COST =", fitted_til)
    print("shares =", dict(zip((f"{n}[{k!r}]" for n, k in SHARES), fitted_shares)))

    def report(label, model_ref, model_til):
        worst = 1.0
        for row in rows:
            chosen = _choice(row, *_estimates(row, model_ref, model_til))
            measured = _measured(row)
            ratio = measured[chosen] / min(measured.values())
            worst = max(worst, ratio)
            if ratio > 1.1:
                print(
                    f"  {label} model: {row['lead']}/{row['kv_heads']} T={row['T']} S={row['n']}"
                    f" d={row['d']} causal={row['causal']}: takes {chosen}, {ratio:.2f} x the "
                    "faster"
                )
        print(f"{label} model: worst chosen/faster {worst:.2f}")

    report("fitted", fitted_ref, fitted_til)
    for name, table in current.items():
        setattr(cost_model, name, table)
    report("current", REFERENCE_COST, TILED_COST)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", choices=["tiles", "threshold", "auto"])
    parser.add_argument("--save", type=Path, help="auto: write the measured rows (JSON) here")
    parser.add_argument(
        "--load",
        type=Path,
        nargs="+",
        help="auto: fit to these rows instead of measuring (files of --save, or `make bench`'s "
        "JSON results, whose auto grid they use)",
    )
    args = parser.parse_args(argv)
    what = args.what or ["tiles", "threshold", "auto"]
    if "tiles" in what:
        tiles()
    if "threshold" in what:
        threshold()
    if "auto" in what:
        rows = [row for path in args.load for row in load_rows(path)] if args.load else None
        if rows is None:
            rows = measure_auto()
            if args.save:
                args.save.write_text(json.dumps(rows, indent=1))
        auto(rows)


if __name__ == "__main__":
    main()
