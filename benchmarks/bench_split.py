"""Section "split": where the time goes, on one core.

The CPU time of torch, of ours, and of ours with the elementwise exponential replaced by an
absolute value, which bounds what any rearrangement of the NumPy calls around NumPy's own
``exp`` could gain. With ``--baseline REV`` the baseline's tiled path is timed in the same
rounds.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
from bench_common import D, fmt, fmt_time, in_turn

QUICK_N = 2048  # the length of --quick runs (4096 otherwise)


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


def run(args, torch, baseline, report) -> None:
    """The section, into ``report["time_split"]``."""
    report["time_split"] = time_split(torch, n=QUICK_N if args.quick else 4096, baseline=baseline)


def lines(report) -> list[str]:
    """The section's Markdown (nothing if it did not run)."""
    return split_lines(report["time_split"]) if report.get("time_split") else []
