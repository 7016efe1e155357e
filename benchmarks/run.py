"""Benchmark: sdpa's tiled attention against PyTorch's CPU flash kernel and the textbook formula.

Run with ``make bench`` (or ``.venv/bin/python benchmarks/run.py [--quick]``). Writes
``benchmarks/results/latest.json`` and ``latest.md`` (``quick.*`` with ``--quick``).

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
  elementwise exponential replaced by a multiplication, which bounds what any rearrangement of
  the NumPy calls around NumPy's own ``exp`` could gain.

The implementations are timed interleaved, round after round, with a pause between calls:
OpenBLAS and torch worker threads keep spinning for about 0.1 s after a call and slow down
whatever runs next. The 1-minute load average before and after the run is recorded, because
other processes on the machine change every number here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

import sdpa
from sdpa import scaled_dot_product_attention

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
D = 64
FULL_NS = [1024, 2048, 4096, 8192, 16384]
QUICK_NS = [1024, 2048]
IDLE = 0.15  # seconds between timed calls
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
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "sdpa": sdpa.__version__,
        "platform": platform.platform(),
    }
    try:
        from threadpoolctl import threadpool_info

        blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if blas:
            info["blas"] = f"{blas[0].get('internal_api')} {blas[0].get('version')} ({blas[0].get('architecture')})"
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


def repeats_for(n: int, heads: int) -> int:
    work = heads * n * n
    if work <= 2048**2:
        return 7
    if work <= 4096**2:
        return 5
    return 3


def run_case(case, torch, peaks, idle) -> dict:
    B, H = case["batch"]
    n, dtype, is_causal = case["n"], np.dtype(case["dtype"]), case["causal"]
    rng = np.random.default_rng(n + 7 * B * H + is_causal)
    q, k, v = (rng.standard_normal((B, H, n, D)).astype(dtype) for _ in range(3))
    io_bytes = q.nbytes  # the output has the size of one input
    flops = 4 * n * n * D * B * H * (0.5 if is_causal else 1.0)

    impls = {"ours": lambda: scaled_dot_product_attention(q, k, v, is_causal=is_causal)}
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
        F = torch.nn.functional

        def run_torch():
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=is_causal)

        impls["torch"] = run_torch

    # Warm-up call of each, measuring memory; keep the outputs for the errors.
    outputs, memory = {}, {}
    for name, f in impls.items():
        time.sleep(idle)
        gc.collect()
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
        del out

    rows = np.unique(np.linspace(0, n - 1, 128).astype(int))
    exact = exact_rows(q[0, 0], k[0, 0], v[0, 0], is_causal, rows)
    errors = {
        name: float(np.max(np.abs(o[0, 0, rows].astype(np.longdouble) - exact)))
        for name, o in outputs.items()
    }
    del outputs

    times = {name: [] for name in impls}
    r = repeats_for(n, B * H)
    for i in range(r):
        for name, f in impls.items():
            if name == "textbook" and n * n * B * H >= 8192**2 and i >= 2:
                continue  # the slow formula at the largest sizes: two rounds are enough
            time.sleep(idle)
            t = time.perf_counter()
            out = f()
            times[name].append(time.perf_counter() - t)
            del out
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
    result["speedup_textbook"] = (
        result["time"]["textbook"] / t_ours if "textbook" in result["time"] else None
    )
    return result


def time_split(torch, n=4096, rounds=5) -> list[dict]:
    """Where the time goes, on one core: torch, ours, and ours with the exponential removed.

    Both libraries run on the calling thread (``torch.set_num_threads(1)``, BLAS held to one
    thread, ``workers=1``), so ``time.thread_time`` measures their CPU time and other processes
    on the machine disturb it little. The third variant swaps the kernel's elementwise
    exponential for a multiplication (its results are wrong; only its time matters): what is
    left is the matrix products and the bookkeeping, which is what a faster exponential could
    at best reduce our time to.
    """
    from threadpoolctl import threadpool_limits

    from sdpa import tiled
    from sdpa.attention import prepare_attention

    def no_exp(x, out):
        return np.multiply(x, 0.0, out=out)

    rows = []
    threads = None if torch is None else torch.get_num_threads()
    try:
        if torch is not None:
            torch.set_num_threads(1)
        for dtype in ("float32", "float64"):
            rng = np.random.default_rng(1)
            q, k, v = (rng.standard_normal((1, 1, n, D)).astype(dtype) for _ in range(3))
            problem = prepare_attention(q, k, v)

            def ours():
                tiled.attention_tiled(problem, workers=1)

            def ours_no_exp():
                tiled._tile_exp = no_exp
                try:
                    tiled.attention_tiled(problem, workers=1)
                finally:
                    tiled._tile_exp = np.exp

            impls = {"ours": ours, "ours without exp": ours_no_exp}
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

                def run_torch():
                    with torch.no_grad():
                        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

                impls["torch"] = run_torch
            times = {name: [] for name in impls}
            with threadpool_limits(1, user_api="blas"):
                for f in impls.values():
                    f()
                for _ in range(rounds):
                    for name, f in impls.items():
                        start = time.thread_time()
                        f()
                        times[name].append(time.thread_time() - start)
            row = {"dtype": dtype, "n": n, "cpu": {k: statistics.median(t) for k, t in times.items()}}
            print(f"one core, {dtype}, n={n}: " + ", ".join(
                f"{k} {fmt_time(t)}" for k, t in row["cpu"].items()), flush=True)
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
        "ours/torch, causal": geomean(sel(lambda r: r["causal"], "ratio_torch")),
        "ours/torch, not causal": geomean(sel(lambda r: not r["causal"], "ratio_torch")),
        "ours/torch, float32": geomean(sel(lambda r: r["dtype"] == "float32", "ratio_torch")),
        "ours/torch, float64": geomean(sel(lambda r: r["dtype"] == "float64", "ratio_torch")),
    }
    for dtype in ("float32", "float64"):
        s[f"textbook/ours, {dtype}, n >= 4096"] = geomean(
            sel(lambda r: r["dtype"] == dtype and r["n"] >= 4096 and r["batch"] == [1, 1],
                "speedup_textbook")
        )
        s[f"min textbook/ours, {dtype}, n >= 4096"] = min(
            sel(lambda r: r["dtype"] == dtype and r["n"] >= 4096 and r["speedup_textbook"],
                "speedup_textbook"),
            default=None,
        )
    big = [r for r in results if r["n"] == 16384 and r["dtype"] == "float32" and r["batch"] == [1, 1]]
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


def markdown(report) -> str:
    m = report["machine"]
    lines = [
        f"# Benchmark results ({'quick' if report['quick'] else 'full'} run)",
        "",
        f"- date: {report['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores; {m.get('blas', 'BLAS unknown')}",
        f"- software: Python {m['python']}, NumPy {m['numpy']}, torch {report.get('torch', 'absent')}, sdpa {m['sdpa']}",
        f"- matrix-multiply peak (NumPy BLAS, all cores): float32 {report['peaks']['float32']:.1f} GFLOP/s, "
        f"float64 {report['peaks']['float64']:.1f} GFLOP/s",
        f"- load average (1 min) before / after: {report['load'][0]:.2f} / {report['load'][1]:.2f}",
        f"- head width {D}; time is the median over interleaved rounds; error is the max abs error on 128 rows against np.longdouble",
        "",
        "| dtype | causal | B x H | n | ours | torch | textbook | ours/torch | textbook/ours | "
        "ours GFLOP/s | % peak | torch % peak | ours extra MiB | textbook extra MiB | torch extra MiB | ours error | torch error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        t = r["time"]
        mem = r["memory"]
        lines.append(
            "| {dtype} | {causal} | {bh} | {n} | {ours} | {torch} | {text} | {rt} | {st} | {gf} | {pk} | {tpk} | {mo} | {mt} | {mto} | {eo} | {et} |".format(
                dtype=r["dtype"],
                causal="yes" if r["causal"] else "no",
                bh=f"{r['batch'][0]} x {r['batch'][1]}",
                n=r["n"],
                ours=fmt_time(t["ours"]),
                torch=fmt_time(t["torch"]) if "torch" in t else "n/a",
                text=fmt_time(t["textbook"]) if "textbook" in t else "skipped",
                rt=fmt(r["ratio_torch"], ".2f"),
                st=fmt(r["speedup_textbook"], ".1f"),
                gf=f"{r['gflops']['ours']:.1f}",
                pk=f"{100 * r['peak_share']['ours']:.0f}",
                tpk=f"{100 * r['peak_share']['torch']:.0f}" if "torch" in t else "n/a",
                mo=f"{mem['ours'] / 2**20:.1f}",
                mt=f"{mem['textbook'] / 2**20:.0f}" if "textbook" in mem else "n/a",
                mto=fmt(None if mem.get("torch") is None else mem["torch"] / 2**20, ".1f"),
                eo=f"{r['error']['ours']:.1e}",
                et=f"{r['error']['torch']:.1e}" if "torch" in r["error"] else "n/a",
            )
        )
    notes = [f"- n={r['n']} {r['dtype']} causal={r['causal']}: textbook {why}"
             for r in report["results"] for why in r["skipped"].values()]
    if notes:
        lines += ["", "Skipped:", *notes]
    lines += ["", "## Summary (geometric means)", ""]
    for key, value in report["summary"].items():
        lines.append(f"- {key}: {fmt(value, '.3f')}")
    split = report.get("time_split")
    if split:
        lines += [
            "",
            "## Where the time goes (one core, CPU time, no mask)",
            "",
            "torch and ours on one thread each; \"ours without exp\" is our kernel with its",
            "elementwise exponential replaced by a multiplication (wrong results, timing only).",
            "",
            "| dtype | n | torch | ours | ours without exp | ours/torch | without exp/torch | exp share of ours |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in split:
            c = r["cpu"]
            t = c.get("torch")
            lines.append(
                f"| {r['dtype']} | {r['n']} | {fmt_time(t) if t else 'n/a'} | {fmt_time(c['ours'])} "
                f"| {fmt_time(c['ours without exp'])} | {fmt(c['ours'] / t if t else None, '.2f')} "
                f"| {fmt(c['ours without exp'] / t if t else None, '.2f')} "
                f"| {1 - c['ours without exp'] / c['ours']:.0%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n in {1024, 2048} only")
    parser.add_argument("--idle", type=float, default=IDLE, help="pause between calls, s")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)

    try:
        import torch

        torch.set_num_threads(2)
    except ImportError:
        torch = None
        print("torch is not installed: ratios to torch are not measured", file=sys.stderr)

    report = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "machine": machine(),
        "torch": None if torch is None else torch.__version__,
    }
    load0 = os.getloadavg()[0]
    report["peaks"] = {name: gemm_peak(np.dtype(name)) for name in ("float32", "float64")}
    print(f"GEMM peak: {report['peaks']}", flush=True)
    results = []
    for case in case_list(args.quick):
        r = run_case(case, torch, report["peaks"], args.idle)
        r["load"] = os.getloadavg()[0]
        results.append(r)
        print(
            f"{case['dtype']} causal={case['causal']!s:5} {case['batch']} n={case['n']:6}: "
            f"ours {fmt_time(r['time']['ours'])}, ours/torch {fmt(r['ratio_torch'], '.2f')}, "
            f"textbook/ours {fmt(r['speedup_textbook'], '.1f')}, "
            f"{100 * r['peak_share']['ours']:.0f}% peak, "
            f"extra {r['memory']['ours'] / 2**20:.1f} MiB, error {r['error']['ours']:.1e} "
            f"(torch {r['error'].get('torch', float('nan')):.1e})",
            flush=True,
        )
    report["load"] = [load0, os.getloadavg()[0]]
    # The peak is measured again at the end and the better value kept: on a shared machine one
    # measurement may fall in a busy moment. Shares of the peak are recomputed with it.
    for name in report["peaks"]:
        report["peaks"][name] = max(report["peaks"][name], gemm_peak(np.dtype(name)))
    for r in results:
        r["peak_share"] = {k: g / report["peaks"][r["dtype"]] for k, g in r["gflops"].items()}
    report["results"] = results
    report["summary"] = summarise(results)
    report["time_split"] = time_split(torch, n=QUICK_NS[-1] if args.quick else 4096)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "quick" if args.quick else "latest"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
