"""Benchmark: sdpa's tiled attention against PyTorch's CPU flash kernel and the textbook formula.

Run with ``make bench`` (or ``.venv/bin/python benchmarks/run.py [--quick]``). Writes
``latest.json`` and ``latest.md`` (``quick.*`` with ``--quick``) into ``_build/bench/`` (not
tracked), or ``--out DIR``; ``--refresh`` (``make bench REFRESH=1``) writes them into
``benchmarks/results/``, the tracked results that the book and the README cite. ``--baseline
REV`` also times the package as it was at git revision ``REV``, interleaved with the rest, so
that a change's effect on speed is measured in one run on one machine. ``--only`` runs some
sections: ``torch`` (the table below), ``auto`` (the ``implementation="auto"`` grid),
``split`` (where the time goes) and ``flex`` (``sdpa.flex_attention`` with and without a
causal block mask).

For every case, one head of width 64 unless stated, inputs with unit-normal entries:

* median wall time of ``sdpa.scaled_dot_product_attention`` (``implementation="auto"``, which
  takes the tiled path here), of ``torch.nn.functional.scaled_dot_product_attention`` on 4-D
  tensors sharing the NumPy buffers (``torch.set_num_threads(2)``, so it runs its flash kernel),
  and of sdpa's reference path (the textbook formula: scores, softmax, weights @ values);
* GFLOP/s counting ``4 T S Dk`` per head (half of it under a causal mask) and the share of the
  machine's matrix-multiply peak, measured here with NumPy's BLAS on all cores;
* peak memory beyond inputs and output (tracemalloc for NumPy, peak RSS for torch);
* the largest absolute error against an extended-precision (``np.longdouble``) evaluation of
  128 query rows spread over the sequence, for ours and for torch;
* where the time goes: on one core, the CPU time of torch, of ours, and of ours with the
  elementwise exponential replaced by an absolute value, which bounds what any rearrangement of
  the NumPy calls around NumPy's own ``exp`` could gain;
* the ``"auto"`` grid: many small heads, few large ones and batched heads, each timed with
  ``implementation="auto"``, ``"reference"`` and ``"tiled"``; ``auto`` should be within 10 % of
  the faster of the two on every case;
* programmable attention: ``sdpa.flex_attention`` at T = S = 4096, 8 heads of width 64,
  float32, without a mask and with a causal ``BlockMask`` (which skips the blocks above the
  diagonal: the causal call should take at most 0.6 of the time of the unmasked one), against
  ``scaled_dot_product_attention(is_causal=True)``; and the time ``create_block_mask`` takes.

The implementations are timed interleaved, round after round, with a pause between calls:
OpenBLAS and torch worker threads keep spinning for about 0.1 s after a call and slow down
whatever runs next. The 1-minute load average before and after the run is recorded, because
other processes on the machine change every number here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.util
import io
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

import sdpa
from sdpa import scaled_dot_product_attention

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"  # tracked: written only with --refresh
DEFAULT_OUT = REPO / "_build" / "bench"  # untracked
SECTIONS = ("torch", "auto", "split", "flex")
D = 64
FULL_NS = [1024, 2048, 4096, 8192, 16384]
QUICK_NS = [1024, 2048]
IDLE = 0.15  # seconds between timed calls
ROUND_BUDGET = 1.0  # seconds of the default path's calls per case (see repeats_for)
# Interleaved rounds of the programmable-attention case, whose ratio has a target: with the 3
# rounds of repeats_for, causal/none moved between 0.59 and 0.64 from one run to the next.
FLEX_ROUNDS = 11
MEMORY_SHARE = 0.35  # run the textbook formula only if its estimate fits in this share of RAM


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "unset"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "sdpa": sdpa.__version__,
        "platform": platform.platform(),
    }
    try:
        from threadpoolctl import threadpool_info

        blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if blas:
            info["blas"] = (
                f"{blas[0].get('internal_api')} {blas[0].get('version')} ({blas[0].get('architecture')})"
            )
    except ImportError:
        pass
    return info


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def gemm_peak(dtype, n=2048, repeats=5) -> float:
    """GFLOP/s of one large matrix product with NumPy's BLAS on all cores (best of a few)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty_like(a)
    best = math.inf
    for _ in range(repeats):
        time.sleep(IDLE)
        t = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


class RSSPeak:
    """Peak resident memory of this process during a block (Linux: /proc/self/clear_refs)."""

    @staticmethod
    def _read(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise OSError(field)

    def __enter__(self):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        self.before = self._read("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = self._read("VmHWM") - self.before


def load_baseline(rev: str):
    """The package ``sdpa`` as it was at git revision ``rev``, imported as ``sdpa_baseline``.

    The package uses relative imports only, so its files can live under another name beside
    the current one; both are then timed in the same process, interleaved.
    """
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "src/sdpa"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {rev}: git archive failed: {archive.stderr.decode().strip()}")
    dest = Path(tempfile.mkdtemp(prefix="sdpa-baseline-"))
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    package = dest / "src" / "sdpa"
    spec = importlib.util.spec_from_file_location(
        "sdpa_baseline", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["sdpa_baseline"] = module
    spec.loader.exec_module(module)
    return module


def in_turn(impls: dict, i: int) -> list:
    """Round ``i``'s order: forwards in even rounds, backwards in odd ones, so that no
    implementation always runs right after the same other one (torch's threads, for one,
    keep spinning briefly after a call)."""
    items = list(impls.items())
    return items if i % 2 == 0 else items[::-1]


def exact_rows(q, k, v, is_causal, rows):
    """out[rows] in extended precision, straight from the formula."""
    ql = q[..., rows, :].astype(np.longdouble)
    kl = k.astype(np.longdouble)
    vl = v.astype(np.longdouble)
    scores = ql @ np.swapaxes(kl, -1, -2) / np.sqrt(np.longdouble(q.shape[-1]))
    if is_causal:
        scores = np.where(np.arange(k.shape[-2])[None, :] <= rows[:, None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ vl


def case_list(quick: bool):
    ns = QUICK_NS if quick else FULL_NS
    cases = []
    for dtype in ("float32", "float64"):
        for is_causal in (False, True):
            for n in ns:
                cases.append(dict(batch=(1, 1), n=n, dtype=dtype, causal=is_causal))
            if not quick:
                cases.append(dict(batch=(4, 8), n=1024, dtype=dtype, causal=is_causal))
    return cases


def repeats_for(seconds: float) -> int:
    """Interleaved rounds for a case whose default path took ``seconds`` per call: as many as
    give about ``ROUND_BUDGET`` seconds of it, 3 to 11. (With a fixed 3 rounds for every
    large case, the batched heads' ratio to torch moved from 1.09 to 1.50 between runs.)"""
    return max(3, min(11, math.ceil(ROUND_BUDGET / max(seconds, 1e-6))))


def case_implementations(case, q, k, v, torch, baseline=None) -> tuple[dict, dict]:
    """``(impls, skipped)``: a call of no argument per implementation, and why any is left out.

    The textbook formula is left out when its ``(T, S)`` arrays would not fit comfortably in
    the memory available.
    """
    B, H = case["batch"]
    n, dtype, is_causal = case["n"], q.dtype, case["causal"]
    impls = {"ours": lambda: scaled_dot_product_attention(q, k, v, is_causal=is_causal)}
    if baseline is not None:
        impls["baseline"] = lambda: baseline.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal
        )
    skipped = {}
    textbook_estimate = 4 * B * H * n * n * dtype.itemsize  # scores, exp, weights, mask
    if textbook_estimate <= MEMORY_SHARE * mem_available():
        impls["textbook"] = lambda: scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, implementation="reference"
        )
    else:
        skipped["textbook"] = (
            f"skipped: needs about {textbook_estimate / 2**30:.1f} GiB, more than "
            f"{MEMORY_SHARE:.0%} of the {mem_available() / 2**30:.1f} GiB available"
        )
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

        def run_torch():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=is_causal
                )

        impls["torch"] = run_torch
    return impls, skipped


def warm_up_with_memory(impls: dict, io_bytes: int, idle: float) -> tuple[dict, dict, dict]:
    """One call of each implementation: ``(outputs, memory, seconds)``, the memory beyond the
    inputs and output (tracemalloc for NumPy, the peak resident size for torch) and the wall
    time of that first call (memory tracing included)."""
    outputs, memory, seconds = {}, {}, {}
    for name, f in impls.items():
        time.sleep(idle)
        gc.collect()
        start = time.perf_counter()
        if name == "torch":
            try:
                with RSSPeak() as peak:
                    out = f()
                memory[name] = max(0, peak.peak - io_bytes)
            except OSError:
                out = f()
                memory[name] = None
            outputs[name] = out.numpy()
        else:
            tracemalloc.start()
            out = f()
            memory[name] = tracemalloc.get_traced_memory()[1] - io_bytes
            tracemalloc.stop()
            outputs[name] = out
        seconds[name] = time.perf_counter() - start
        del out
    return outputs, memory, seconds


def errors_against_exact(outputs: dict, q, k, v, is_causal) -> dict:
    """Each output's largest error on 128 rows of the first head, against long double."""
    n = q.shape[-2]
    rows = np.unique(np.linspace(0, n - 1, 128).astype(int))
    exact = exact_rows(q[0, 0], k[0, 0], v[0, 0], is_causal, rows)
    return {
        name: float(np.max(np.abs(o[0, 0, rows].astype(np.longdouble) - exact)))
        for name, o in outputs.items()
    }


def interleaved_times(impls: dict, rounds: int, idle: float, slow_after=None) -> dict:
    """Wall times of each implementation over ``rounds`` interleaved rounds.

    ``slow_after``: the name of an implementation timed in two rounds only (the textbook
    formula at the largest sizes).
    """
    times = {name: [] for name in impls}
    for i in range(rounds):
        for name, f in in_turn(impls, i):
            if name == slow_after and i >= 2:
                continue
            time.sleep(idle)
            t = time.perf_counter()
            out = f()
            times[name].append(time.perf_counter() - t)
            del out
    return times


def run_case(case, torch, peaks, idle, baseline=None) -> dict:
    """Time one case: the implementations interleaved, their memory, errors and ratios."""
    B, H = case["batch"]
    n, dtype, is_causal = case["n"], np.dtype(case["dtype"]), case["causal"]
    rng = np.random.default_rng(n + 7 * B * H + is_causal)
    q, k, v = (rng.standard_normal((B, H, n, D)).astype(dtype) for _ in range(3))
    flops = 4 * n * n * D * B * H * (0.5 if is_causal else 1.0)

    impls, skipped = case_implementations(case, q, k, v, torch, baseline)
    outputs, memory, seconds = warm_up_with_memory(impls, q.nbytes, idle)  # out: q's size
    errors = errors_against_exact(outputs, q, k, v, is_causal)
    del outputs
    slow = "textbook" if n * n * B * H >= 8192**2 else None
    times = interleaved_times(impls, repeats_for(seconds["ours"]), idle, slow_after=slow)

    result = dict(case)
    result["batch"] = list(case["batch"])
    result["flops"] = flops
    result["repeats"] = {name: len(t) for name, t in times.items()}
    result["time"] = {name: statistics.median(t) for name, t in times.items()}
    result["gflops"] = {name: flops / t / 1e9 for name, t in result["time"].items()}
    result["peak_share"] = {name: g / peaks[case["dtype"]] for name, g in result["gflops"].items()}
    result["memory"] = memory
    result["error"] = errors
    result["skipped"] = skipped
    t_ours = result["time"]["ours"]
    result["ratio_torch"] = t_ours / result["time"]["torch"] if "torch" in impls else None
    if "baseline" in impls:
        t_base = result["time"]["baseline"]
        result["baseline_ratio_torch"] = (
            t_base / result["time"]["torch"] if "torch" in impls else None
        )
        result["ours_over_baseline"] = t_ours / t_base
    result["speedup_textbook"] = (
        result["time"]["textbook"] / t_ours if "textbook" in result["time"] else None
    )
    return result


def baseline_tiled_one_thread(baseline, q, k, v, is_causal):
    """A call of the baseline's tiled path on one thread, whichever layout the baseline has.

    Since issue 16 the problem lives in ``sdpa.problem`` and the thread count is
    ``num_threads``; before, ``sdpa.attention.prepare_attention`` and ``workers``.
    """
    if hasattr(baseline, "problem"):
        problem = baseline.problem.prepare_attention(q, k, v, None, is_causal)
        return lambda: baseline.tiled.attention_tiled(problem, num_threads=1)
    problem = baseline.attention.prepare_attention(q, k, v, None, is_causal)
    return lambda: baseline.tiled.attention_tiled(problem, workers=1)


def time_split(torch, n=4096, rounds=11, baseline=None) -> list[dict]:
    """Where the time goes, on one core: torch, ours, and ours with the exponential removed.

    Both libraries run on the calling thread (``torch.set_num_threads(1)``, BLAS held to one
    thread, ``num_threads=1``), so ``time.thread_time`` measures their CPU time and other processes
    on the machine disturb it little. The third variant swaps the kernel's elementwise
    exponential for an absolute value (its results are wrong; only its time matters): what is
    left is the matrix products and the bookkeeping, which is what a faster exponential could
    at best reduce our time to. With a ``baseline`` package its tiled path is timed too, in
    the same rounds: the comparison of two versions that a loaded machine disturbs least.
    Each dtype runs without a mask and with a causal one.
    """
    from threadpoolctl import threadpool_limits

    from sdpa.problem import prepare_attention
    from sdpa.tiled import attention_tiled

    def no_exp(x, out):  # one cheap pass; row sums large enough that no block is walked twice
        return np.abs(x, out=out)

    rows = []
    threads = None if torch is None else torch.get_num_threads()
    try:
        if torch is not None:
            torch.set_num_threads(1)
        for dtype, is_causal in itertools.product(("float32", "float64"), (False, True)):
            rng = np.random.default_rng(1)
            q, k, v = (rng.standard_normal((1, 1, n, D)).astype(dtype) for _ in range(3))
            problem = prepare_attention(q, k, v, None, is_causal)

            def ours(problem=problem):
                attention_tiled(problem, num_threads=1)

            def ours_no_exp(problem=problem):
                attention_tiled(problem, num_threads=1, exp=no_exp)

            impls = {"ours": ours, "ours without exp": ours_no_exp}
            if baseline is not None:
                impls["baseline"] = baseline_tiled_one_thread(baseline, q, k, v, is_causal)
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

                def run_torch(tq=tq, tk=tk, tv=tv, is_causal=is_causal):
                    with torch.no_grad():
                        torch.nn.functional.scaled_dot_product_attention(
                            tq, tk, tv, is_causal=is_causal
                        )

                impls["torch"] = run_torch
            times = {name: [] for name in impls}
            with threadpool_limits(1, user_api="blas"):
                for f in impls.values():
                    f()
                for i in range(rounds):
                    for name, f in in_turn(impls, i):
                        start = time.thread_time()
                        f()
                        times[name].append(time.thread_time() - start)
            # the best round: CPU time is inflated, never deflated, by other processes' use of
            # the shared caches and memory bus
            row = {
                "dtype": dtype,
                "n": n,
                "causal": is_causal,
                "cpu": {k: min(t) for k, t in times.items()},
            }
            print(
                f"one core, {dtype}, n={n}, causal={is_causal}: "
                + ", ".join(f"{k} {fmt_time(t)}" for k, t in row["cpu"].items()),
                flush=True,
            )
            rows.append(row)
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    return rows


def geomean(xs):
    xs = [x for x in xs if x is not None]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def summarise(results) -> dict:
    def sel(pred, key):
        return [r[key] for r in results if pred(r)]

    s = {
        "ours/torch, all": geomean(sel(lambda r: True, "ratio_torch")),
        "baseline/torch, all": geomean(
            [r["baseline_ratio_torch"] for r in results if r.get("baseline_ratio_torch")]
        ),
        "ours/baseline, all": geomean(
            [r["ours_over_baseline"] for r in results if r.get("ours_over_baseline")]
        ),
        "max ours/baseline": max(
            (r["ours_over_baseline"] for r in results if r.get("ours_over_baseline")),
            default=None,
        ),
        "ours/torch, causal": geomean(sel(lambda r: r["causal"], "ratio_torch")),
        "ours/torch, not causal": geomean(sel(lambda r: not r["causal"], "ratio_torch")),
        "ours/torch, float32": geomean(sel(lambda r: r["dtype"] == "float32", "ratio_torch")),
        "ours/torch, float64": geomean(sel(lambda r: r["dtype"] == "float64", "ratio_torch")),
    }
    for dtype in ("float32", "float64"):
        s[f"textbook/ours, {dtype}, n >= 4096"] = geomean(
            sel(
                lambda r, dtype=dtype: (
                    r["dtype"] == dtype and r["n"] >= 4096 and r["batch"] == [1, 1]
                ),
                "speedup_textbook",
            )
        )
        s[f"min textbook/ours, {dtype}, n >= 4096"] = min(
            sel(
                lambda r, dtype=dtype: (
                    r["dtype"] == dtype and r["n"] >= 4096 and r["speedup_textbook"]
                ),
                "speedup_textbook",
            ),
            default=None,
        )
    big = [
        r for r in results if r["n"] == 16384 and r["dtype"] == "float32" and r["batch"] == [1, 1]
    ]
    s["ours extra memory MiB, n=16384 float32"] = (
        max(r["memory"]["ours"] for r in big) / 2**20 if big else None
    )
    ratios = [
        r["error"]["ours"] / r["error"]["torch"]
        for r in results
        if "torch" in r["error"] and r["error"]["torch"] > 0
    ]
    s["max error ours/torch"] = max(ratios) if ratios else None
    return s


def fmt_time(t):
    return f"{t * 1e3:.1f} ms" if t < 10 else f"{t:.1f} s"


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def auto_cases(quick: bool) -> list[dict]:
    """The grid on which ``implementation="auto"`` must pick (nearly) the faster path.

    ``lead`` is the batch shape of q, k and v, ``n`` the number of keys S, ``t`` the number of
    queries T (``n`` unless given), ``d`` the head width. Many small heads: the tiled path's
    per-tile work in Python dominates; few large ones: the reference path's (T, S) matrices do;
    batched heads sit in between. Decoding: one query (or a few, as speculative decoding and
    chunked prefill have) against a long cache, at batch 1, with 8 to 64 heads; and with
    grouped-query heads (``kv_heads`` key heads, each shared by ``lead[-1] / kv_heads`` query
    heads, ``enable_gqa``).
    """
    grid = [
        ("many small heads", (20000,), 4, 8, False),  # once 32 times slower on the tiled path
        ("many small heads", (4096,), 16, 16, False),
        ("many small heads", (1024,), 32, 32, True),
        ("many small heads", (256,), 64, 16, False),
        ("few large heads", (1,), 512, 64, False),
        ("few large heads", (1,), 1024, 64, True),
        ("few large heads", (1,), 2048, 64, False),
        ("few large heads", (2,), 4096, 128, True),
        ("batched heads", (4, 8), 128, 64, False),
        ("batched heads", (4, 8), 256, 64, True),
        ("batched heads", (8, 16), 128, 32, False),
        ("batched heads", (2, 8), 512, 64, False),
        ("batched heads", (32,), 256, 128, True),
    ]
    if quick:
        grid = [g for g in grid if math.prod(g[1]) * g[2] ** 2 <= 2**22]
    cases = [
        dict(kind=k, lead=lead, t=n, n=n, d=d, causal=c, dtype="float32")
        for k, lead, n, d, c in grid
    ]
    decoding = [
        (1, 8, 1, 512),
        (1, 8, 1, 4096),
        (1, 8, 1, 16384),
        (1, 64, 1, 512),
        (1, 64, 1, 4096),
        (1, 64, 1, 16384),
        (1, 8, 4, 4096),
        (1, 64, 4, 4096),
        (1, 8, 16, 512),
        (1, 8, 16, 16384),
        (1, 64, 16, 512),
        (1, 64, 16, 4096),
        (1, 64, 16, 16384),
    ]
    if quick:
        decoding = [c for c in decoding if c[1] * c[3] <= 2**16]
    cases += [
        dict(kind="decoding", lead=(b, h), t=t, n=s, d=64, causal=False, dtype="float32")
        for b, h, t, s in decoding
    ]
    # Grouped-query decoding (issue 34), the commonest serving call: 32 or 64 query heads over
    # 8 key heads (enable_gqa), a token or a few against the cache.
    grouped = [(h, t, s) for h in (32, 64) for t in (1, 2, 4, 8) for s in (512, 2048, 4096, 16384)]
    if quick:
        grouped = [c for c in grouped if c[0] * c[1] * c[2] <= 2**17]
    cases += [
        dict(
            kind="GQA decoding",
            lead=(1, h),
            kv_heads=8,
            t=t,
            n=s,
            d=64,
            causal=False,
            dtype="float32",
        )
        for h, t, s in grouped
    ]
    return cases


def run_auto_case(case, idle, rounds=7) -> dict:
    """Time the three implementations interleaved; which path auto takes; auto / faster.

    Times are the best of the rounds, the estimate least disturbed by other processes on a
    shared machine (the question is which path is faster, not how fast either is on average).
    At least ``rounds``; a case whose faster path takes under 50 ms gets up to three times as
    many (a millisecond call's best of 7 still moved by 10 % between runs, auto against the
    same path it takes).
    """
    from sdpa.cost_model import worth_tiling
    from sdpa.problem import prepare_attention

    rng = np.random.default_rng(case["n"] * case["d"] + case["t"])
    gqa = case.get("kv_heads") is not None  # k and v with kv_heads heads, shared by groups
    kv_lead = (*case["lead"][:-1], case["kv_heads"]) if gqa else case["lead"]
    q, k, v = (
        rng.standard_normal((*lead, n, case["d"])).astype(case["dtype"])
        for lead, n in ((case["lead"], case["t"]), (kv_lead, case["n"]), (kv_lead, case["n"]))
    )
    impls = {
        name: (
            lambda name=name: scaled_dot_product_attention(
                q, k, v, is_causal=case["causal"], enable_gqa=gqa, implementation=name
            )
        )
        for name in ("auto", "reference", "tiled")
    }
    times = {name: [] for name in impls}
    warm = {}
    for name, f in impls.items():  # warm-up, and the time per call
        start = time.perf_counter()
        f()
        warm[name] = time.perf_counter() - start
    fastest_call = min(warm["reference"], warm["tiled"])
    rounds = max(rounds, min(3 * rounds, math.ceil(0.05 / max(fastest_call, 1e-6)) * rounds))
    for i in range(rounds):
        for name, f in in_turn(impls, i):
            time.sleep(idle)
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    result = dict(case, lead=list(case["lead"]))
    result["time"] = {name: min(t) for name, t in times.items()}
    result["median"] = {name: statistics.median(t) for name, t in times.items()}
    chosen = worth_tiling(prepare_attention(q, k, v, None, case["causal"], enable_gqa=gqa))
    result["auto takes"] = "tiled" if chosen else "reference"
    fastest = min(result["time"]["reference"], result["time"]["tiled"])
    result["auto/faster"] = result["time"]["auto"] / fastest
    result["chosen/faster"] = result["time"][result["auto takes"]] / fastest
    return result


def flex_cases(quick: bool) -> list[dict]:
    """The programmable-attention cases: B = 1, 8 heads of width 64, float32, T = S = n."""
    return [dict(batch=(1, 8), n=n, d=D, dtype="float32") for n in ([2048] if quick else [4096])]


def run_flex_case(case, idle) -> dict:
    """``flex_attention`` without a mask and with a causal block mask, and
    ``scaled_dot_product_attention(is_causal=True)``, timed interleaved (median of the rounds);
    the ratio of the masked call to the unmasked one, which skipping the empty blocks makes
    about one half (the target is at most 0.6); the same for the first call of each of a
    series of new masks (a mask keeps what ``mask_mod`` gave on its partial blocks for later
    calls); how long ``create_block_mask`` takes; and the largest difference between the two
    causal results."""
    B, H = case["batch"]
    n, dtype = case["n"], np.dtype(case["dtype"])
    rng = np.random.default_rng(n + 23)
    q, k, v = (rng.standard_normal((B, H, n, case["d"])).astype(dtype) for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    creation = []
    for _ in range(5):
        time.sleep(idle)
        start = time.perf_counter()
        mask = sdpa.create_block_mask(causal, None, None, n, n)
        creation.append(time.perf_counter() - start)
    # a new mask for each call of its implementation: the warm-up's and FLEX_ROUNDS rounds'
    new_masks = [sdpa.create_block_mask(causal, None, None, n, n) for _ in range(FLEX_ROUNDS + 1)]
    impls = {
        "flex, no mask": lambda: sdpa.flex_attention(q, k, v),
        "flex, causal block mask": lambda: sdpa.flex_attention(q, k, v, block_mask=mask),
        "flex, a new mask's first call": lambda: sdpa.flex_attention(
            q, k, v, block_mask=new_masks.pop()
        ),
        "sdpa, is_causal": lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    outputs, warm = {}, {}
    for name, f in impls.items():  # warm-up, and the time per call
        time.sleep(idle)
        start = time.perf_counter()
        outputs[name] = f()
        warm[name] = time.perf_counter() - start
    times = interleaved_times(impls, FLEX_ROUNDS, idle)
    result = dict(case, batch=list(case["batch"]))
    result["repeats"] = {name: len(t) for name, t in times.items()}
    result["time"] = {name: statistics.median(t) for name, t in times.items()}
    result["create_block_mask"] = statistics.median(creation)
    result["sparsity"] = mask.sparsity()
    t = result["time"]
    result["causal/none"] = t["flex, causal block mask"] / t["flex, no mask"]
    result["first call/none"] = t["flex, a new mask's first call"] / t["flex, no mask"]
    result["causal/sdpa causal"] = t["flex, causal block mask"] / t["sdpa, is_causal"]
    result["max difference"] = float(
        np.max(np.abs(outputs["flex, causal block mask"] - outputs["sdpa, is_causal"]))
    )
    return result


def flex_lines(flex) -> list[str]:
    """Programmable attention: the causal block mask against no mask and against sdpa."""
    lines = [
        "",
        "## Programmable attention: `flex_attention` with a causal block mask",
        "",
        "Median wall time over interleaved rounds; the block mask's default blocks of 128 x 128 "
        '(the "sparsity" is the share of blocks it skips); "causal/none" is the time with the '
        "causal block mask over the time without a mask (target: at most 0.60); "
        '"first call/none" the same for the first call of a new mask, which evaluates '
        "`mask_mod` on its partial blocks (the mask keeps that for its later calls).",
        "",
        *table(
            [
                "dtype",
                "B x H",
                "n",
                "no mask",
                "causal block mask",
                "sdpa is_causal",
                "causal/none",
                "first call/none",
                "causal/sdpa causal",
                "sparsity %",
                "create_block_mask",
                "max abs difference from sdpa",
            ],
            [
                [
                    r["dtype"],
                    f"{r['batch'][0]} x {r['batch'][1]}",
                    str(r["n"]),
                    fmt_time(r["time"]["flex, no mask"]),
                    fmt_time(r["time"]["flex, causal block mask"]),
                    fmt_time(r["time"]["sdpa, is_causal"]),
                    f"{r['causal/none']:.2f}",
                    f"{r['first call/none']:.2f}",
                    f"{r['causal/sdpa causal']:.2f}",
                    f"{r['sparsity']:.1f}",
                    fmt_time(r["create_block_mask"]),
                    f"{r['max difference']:.1e}",
                ]
                for r in flex
            ],
        ),
    ]
    worst = max(r["causal/none"] for r in flex)
    first = max(r["first call/none"] for r in flex)
    return lines + [
        "",
        f"- worst causal/none: {worst:.2f} (target: at most 0.60)",
        f"- worst first call/none: {first:.2f}",
    ]


def _mib(x, spec=".1f"):
    return fmt(None if x is None else x / 2**20, spec)


# The results table, one (header, cell) pair per column: the one place its columns are defined.
RESULT_COLUMNS = [
    ("dtype", lambda r: r["dtype"]),
    ("causal", lambda r: "yes" if r["causal"] else "no"),
    ("B x H", lambda r: f"{r['batch'][0]} x {r['batch'][1]}"),
    ("n", lambda r: str(r["n"])),
    ("ours", lambda r: fmt_time(r["time"]["ours"])),
    ("torch", lambda r: fmt_time(r["time"]["torch"]) if "torch" in r["time"] else "n/a"),
    (
        "textbook",
        lambda r: fmt_time(r["time"]["textbook"]) if "textbook" in r["time"] else "skipped",
    ),
    ("ours/torch", lambda r: fmt(r["ratio_torch"], ".2f")),
    ("textbook/ours", lambda r: fmt(r["speedup_textbook"], ".1f")),
    ("ours GFLOP/s", lambda r: f"{r['gflops']['ours']:.1f}"),
    ("% peak", lambda r: f"{100 * r['peak_share']['ours']:.0f}"),
    (
        "torch % peak",
        lambda r: fmt(r["peak_share"].get("torch") and 100 * r["peak_share"]["torch"], ".0f"),
    ),
    ("ours extra MiB", lambda r: _mib(r["memory"]["ours"])),
    ("textbook extra MiB", lambda r: _mib(r["memory"].get("textbook"), ".0f")),
    ("torch extra MiB", lambda r: _mib(r["memory"].get("torch"))),
    ("ours error", lambda r: f"{r['error']['ours']:.1e}"),
    ("torch error", lambda r: fmt(r["error"].get("torch"), ".1e")),
]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def results_table(report, headers: list[str] | None = None) -> list[str]:
    """The results as a Markdown table of the columns named in ``headers`` (default: all of
    RESULT_COLUMNS), for this file's report and for any page that shows the results."""
    columns = dict(RESULT_COLUMNS)
    headers = list(columns) if headers is None else headers
    unknown = [h for h in headers if h not in columns]
    if unknown:
        raise ValueError(
            f"headers must be columns of RESULT_COLUMNS {list(columns)}; got {unknown}"
        )
    return table(headers, [[columns[h](r) for h in headers] for r in report["results"]])


def header_lines(report) -> list[str]:
    """Title, date, machine, software and load."""
    m = report["machine"]
    lines = [
        f"# Benchmark results ({'quick' if report['quick'] else 'full'} run)",
        "",
        f"- date: {report['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores; {m.get('blas', 'BLAS unknown')}; "
        f"OPENBLAS_CORETYPE={m.get('OPENBLAS_CORETYPE', 'unset')}",
        f"- software: Python {m['python']}, NumPy {m['numpy']}, "
        f"torch {report.get('torch', 'absent')}, sdpa {m['sdpa']}",
        f"- load average (1 min) before / after: {report['load'][0]:.2f} / {report['load'][1]:.2f}",
    ]
    if report.get("baseline"):
        lines.append(f"- baseline: sdpa at git revision {report['baseline']}, timed interleaved")
    return lines


def results_lines(report) -> list[str]:
    """The main table (RESULT_COLUMNS), what was skipped, the baseline, the summary."""
    lines = [
        f"- matrix-multiply peak (NumPy BLAS, all cores): float32 "
        f"{report['peaks']['float32']:.1f} GFLOP/s, float64 {report['peaks']['float64']:.1f} GFLOP/s",
        f"- head width {D}; time is the median over interleaved rounds; error is the max abs "
        "error on 128 rows against np.longdouble",
        "",
        *results_table(report),
    ]
    notes = [
        f"- n={r['n']} {r['dtype']} causal={r['causal']}: textbook {why}"
        for r in report["results"]
        for why in r["skipped"].values()
    ]
    if notes:
        lines += ["", "Skipped:", *notes]
    if report.get("baseline"):
        lines += [
            "",
            f"## Against the baseline ({report['baseline']})",
            "",
            "Both versions' default path (tiled here), timed in the same rounds as torch.",
            "",
            *table(
                [
                    "dtype",
                    "causal",
                    "B x H",
                    "n",
                    "ours",
                    "baseline",
                    "ours/torch",
                    "baseline/torch",
                    "ours/baseline",
                ],
                [
                    [
                        r["dtype"],
                        "yes" if r["causal"] else "no",
                        f"{r['batch'][0]} x {r['batch'][1]}",
                        str(r["n"]),
                        fmt_time(r["time"]["ours"]),
                        fmt_time(r["time"]["baseline"]),
                        fmt(r["ratio_torch"], ".3f"),
                        fmt(r.get("baseline_ratio_torch"), ".3f"),
                        fmt(r.get("ours_over_baseline"), ".3f"),
                    ]
                    for r in report["results"]
                ],
            ),
        ]
    lines += ["", "## Summary (geometric means)", ""]
    lines += [
        f"- {key}: {fmt(value, '.3f')}"
        for key, value in report["summary"].items()
        if value is not None
    ]
    return lines


def lead_text(case) -> str:
    """The lead of q, and with grouped-query heads the key heads: ``(1, 32 over 8)``."""
    lead = tuple(case["lead"])
    if case.get("kv_heads") is None:
        return str(lead)
    return f"({', '.join(map(str, lead[:-1]))}, {lead[-1]} over {case['kv_heads']})"


def auto_lines(auto) -> list[str]:
    """implementation="auto" against the faster path, case by case."""
    lines = []
    worst = max(r["auto/faster"] for r in auto)
    lines += [
        "",
        '## `implementation="auto"` against the faster path',
        "",
        "float32, q of shape (*lead, T, d), k and v of shape (*lead, S, d) (GQA: H over Hkv "
        "heads, enable_gqa); best of 7 to 21 "
        'interleaved rounds (more for quick cases). "chosen/faster" compares the path auto takes with the faster one '
        'in the same rounds; "auto/faster" times auto itself (the same path, plus the decision).',
        "",
        "| case | lead | T | S | d | causal | reference | tiled | auto | auto takes | chosen/faster | auto/faster |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in auto:
        t = r["time"]
        lines.append(
            f"| {r['kind']} | {lead_text(r)} | {r.get('t', r['n'])} | {r['n']} | {r['d']} | "
            f"{'yes' if r['causal'] else 'no'} | {fmt_time(t['reference'])} | "
            f"{fmt_time(t['tiled'])} | {fmt_time(t['auto'])} | {r['auto takes']} | "
            f"{r['chosen/faster']:.2f} | {r['auto/faster']:.2f} |"
        )
    lines += ["", f"- worst auto/faster: {worst:.2f} (target: at most 1.10)"]
    return lines


def split_lines(split) -> list[str]:
    """Where the time goes, on one core."""
    lines = []
    lines += [
        "",
        "## Where the time goes (one core, CPU time)",
        "",
        'Best of 11 interleaved rounds; torch and ours on one thread each; "ours without '
        'exp" is our kernel with its',
        "elementwise exponential replaced by an absolute value (wrong results, timing only)."
        + (
            ' "baseline" is the tiled path at the baseline revision, in the same rounds.'
            if any("baseline" in r["cpu"] for r in split)
            else ""
        ),
        "",
        "| dtype | causal | n | torch | ours | ours without exp | baseline | ours/torch "
        "| baseline/torch | ours/baseline | without exp/torch | exp share of ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in split:
        c = r["cpu"]
        t = c.get("torch")
        b = c.get("baseline")
        lines.append(
            f"| {r['dtype']} | {'yes' if r.get('causal') else 'no'} | {r['n']} "
            f"| {fmt_time(t) if t else 'n/a'} | {fmt_time(c['ours'])} "
            f"| {fmt_time(c['ours without exp'])} | {fmt_time(b) if b else 'n/a'} "
            f"| {fmt(c['ours'] / t if t else None, '.3f')} "
            f"| {fmt(b / t if t and b else None, '.3f')} "
            f"| {fmt(c['ours'] / b if b else None, '.3f')} "
            f"| {fmt(c['ours without exp'] / t if t else None, '.2f')} "
            f"| {1 - c['ours without exp'] / c['ours']:.0%} |"
        )
    return lines


def markdown(report) -> str:
    """The report as Markdown: each section from its own function, in order."""
    lines = header_lines(report)
    if "results" in report:
        lines += results_lines(report)
    if report.get("auto"):
        lines += auto_lines(report["auto"])
    if report.get("time_split"):
        lines += split_lines(report["time_split"])
    if report.get("flex"):
        lines += flex_lines(report["flex"])
    return "\n".join(lines) + "\n"


def seconds(text: str) -> float:
    """argparse type: a finite, non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds; got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0; got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """Validate every argument, and create the output directory, before anything is timed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n in {1024, 2048} only")
    parser.add_argument("--idle", type=seconds, default=IDLE, help="pause between calls, s")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results directory (default {DEFAULT_OUT.relative_to(REPO)}, untracked)",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="write into benchmarks/results/ (tracked) instead of --out",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also time sdpa as it was at this git revision, interleaved",
    )
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
        help="run only these sections (repeatable); default all",
    )
    args = parser.parse_args(argv)
    if args.refresh and args.out is not None:
        parser.error("--refresh writes into benchmarks/results/; it cannot be combined with --out")
    args.out = RESULTS if args.refresh else (args.out or DEFAULT_OUT)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        parser.error(f"--out {args.out}: cannot create or write this directory ({error.strerror})")
    if args.baseline is not None:
        check = subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "rev-parse",
                "--verify",
                "--quiet",
                args.baseline + "^{commit}",
            ],
            capture_output=True,
            check=False,
        )
        if check.returncode != 0:
            parser.error(f"--baseline {args.baseline}: not a git revision of {REPO}")
    args.sections = tuple(args.only or SECTIONS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    baseline = load_baseline(args.baseline) if args.baseline else None

    try:
        import torch

        torch.set_num_threads(2)
    except ImportError:
        torch = None
        print("torch is not installed: ratios to torch are not measured", file=sys.stderr)

    report = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "machine": machine(),
        "torch": None if torch is None else torch.__version__,
        "baseline": args.baseline,
        "sections": list(args.sections),
    }
    load0 = os.getloadavg()[0]
    if "torch" in args.sections:
        report["peaks"] = {name: gemm_peak(np.dtype(name)) for name in ("float32", "float64")}
        print(f"GEMM peak: {report['peaks']}", flush=True)
        results = []
        for case in case_list(args.quick):
            r = run_case(case, torch, report["peaks"], args.idle, baseline)
            r["load"] = os.getloadavg()[0]
            results.append(r)
            print(
                f"{case['dtype']} causal={case['causal']!s:5} {case['batch']} n={case['n']:6}: "
                f"ours {fmt_time(r['time']['ours'])}, ours/torch {fmt(r['ratio_torch'], '.2f')}, "
                f"baseline/torch {fmt(r.get('baseline_ratio_torch'), '.2f')}, "
                f"textbook/ours {fmt(r['speedup_textbook'], '.1f')}, "
                f"{100 * r['peak_share']['ours']:.0f}% peak, "
                f"extra {r['memory']['ours'] / 2**20:.1f} MiB, error {r['error']['ours']:.1e} "
                f"(torch {r['error'].get('torch', float('nan')):.1e})",
                flush=True,
            )
        # The peak is measured again at the end and the better value kept: on a shared machine
        # one measurement may fall in a busy moment. Shares of the peak are recomputed with it.
        for name in report["peaks"]:
            report["peaks"][name] = max(report["peaks"][name], gemm_peak(np.dtype(name)))
        for r in results:
            r["peak_share"] = {k: g / report["peaks"][r["dtype"]] for k, g in r["gflops"].items()}
        report["results"] = results
        report["summary"] = summarise(results)
    if "auto" in args.sections:
        report["auto"] = []
        for case in auto_cases(args.quick):
            r = run_auto_case(case, args.idle)
            report["auto"].append(r)
            t = r["time"]
            print(
                f"auto grid {case['kind']:16} {lead_text(case):15} T={case['t']:5} S={case['n']:5} "
                f"d={case['d']:3} causal={case['causal']!s:5}: reference "
                f"{fmt_time(t['reference'])}, tiled {fmt_time(t['tiled'])}, auto "
                f"{fmt_time(t['auto'])} ({r['auto takes']}), auto/faster {r['auto/faster']:.2f}",
                flush=True,
            )
    if "split" in args.sections:
        report["time_split"] = time_split(
            torch, n=QUICK_NS[-1] if args.quick else 4096, baseline=baseline
        )
    if "flex" in args.sections:
        report["flex"] = []
        for case in flex_cases(args.quick):
            r = run_flex_case(case, args.idle)
            report["flex"].append(r)
            t = r["time"]
            print(
                f"flex {case['batch']} n={case['n']}: no mask {fmt_time(t['flex, no mask'])}, "
                f"causal block mask {fmt_time(t['flex, causal block mask'])}, sdpa is_causal "
                f"{fmt_time(t['sdpa, is_causal'])}, causal/none {r['causal/none']:.2f}",
                flush=True,
            )
    report["load"] = [load0, os.getloadavg()[0]]
    stem = "quick" if args.quick else "latest"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"written: {args.out / (stem + '.md')} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
