"""Section "auto": ``implementation="auto"`` against the faster of the two paths.

Many small heads, few large ones, batched heads and decoding (with grouped-query heads), each
timed with ``implementation="auto"``, ``"reference"`` and ``"tiled"``; ``auto`` should be
within 10 % of the faster of the two on every case.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from bench_common import fmt_time, in_turn

from sdpa import scaled_dot_product_attention


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


#: Most interleaved rounds of one case (its fastest calls, of a few milliseconds) ...
MAX_ROUNDS = 33
#: ... and about the most seconds of calls it takes (a slow path's 1.3 s calls: few rounds).
CASE_SECONDS = 10.0
#: Fresh processes a case's rounds are shared among (each a third of them) ...
PROCESSES = 3
#: ... and the fewest rounds each runs (a slow case's).
MIN_ROUNDS = 3


def _inputs(case):
    """``(q, k, v, enable_gqa)`` of a case, the same in every process."""
    rng = np.random.default_rng(case["n"] * case["d"] + case["t"])
    gqa = case.get("kv_heads") is not None  # k and v with kv_heads heads, shared by groups
    kv_lead = (*case["lead"][:-1], case["kv_heads"]) if gqa else case["lead"]
    q, k, v = (
        rng.standard_normal((*lead, n, case["d"])).astype(case["dtype"])
        for lead, n in ((case["lead"], case["t"]), (kv_lead, case["n"]), (kv_lead, case["n"]))
    )
    return q, k, v, gqa


def time_in_this_process(case, idle, rounds) -> dict:
    """``{path: [seconds of each round]}``: the three implementations, interleaved, after a
    warm-up; ``rounds`` at least, more for a fast case (see :func:`run_auto_case`)."""
    q, k, v, gqa = _inputs(case)
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
    wanted = math.ceil(0.5 / max(fastest_call, 1e-6) / PROCESSES)  # 0.5 s of the faster path
    affordable = math.ceil(CASE_SECONDS / PROCESSES / max(sum(warm.values()), 1e-6))
    rounds = max(rounds, min(MAX_ROUNDS // PROCESSES, wanted, affordable))
    collecting = gc.isenabled()
    gc.disable()
    try:
        for i in range(rounds):
            for name, f in in_turn(impls, i):
                time.sleep(idle)
                start = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - start)
    finally:
        if collecting:
            gc.enable()
    return times


def run_auto_case(case, idle, rounds=MIN_ROUNDS) -> dict:
    """Time the three implementations interleaved; which path auto takes; auto / faster.

    The rounds are shared among ``PROCESSES`` fresh processes, one after the other, and
    pooled: a process's medians of 31 rounds measured auto and the tiled path it takes, the
    same code but for a decision of 45 us, 6.6 % apart on a 5 ms call, and 1 % apart in the
    next process (where its arrays and buffers land differs from process to process; pyperf
    spreads its runs over processes for the same reason). The ratios compare medians of the
    pooled rounds. The best round of each path (kept as ``time``, which
    ``benchmarks/tune.py`` fits) is an extreme: auto's best and the best of the path it takes
    were up to 1.2 apart on a 3 ms call. Each process runs at least ``rounds`` rounds; a
    faster case gets as many as fill about half a second of the faster path in all, up to
    ``MAX_ROUNDS`` and ``CASE_SECONDS`` of calls. Each call follows a pause of ``idle``
    seconds: after a pause of 0.01 s instead of 0.15 the tiled path took 1.2 to 1.45 times as
    long (32 causal heads of 256 x 256; 8 heads of 16 queries over 16384 keys; medians of 15
    interleaved rounds), while the reference path took 0.9 of its time; OpenBLAS's threads
    spin for a while after a product, and likely compete with the tiled path's. The garbage
    collector is off while timing, as in :mod:`timeit`.
    """
    from sdpa.cost_model import worth_tiling
    from sdpa.problem import prepare_attention

    times = {name: [] for name in ("auto", "reference", "tiled")}
    spawn = multiprocessing.get_context("spawn")
    for _ in range(PROCESSES):  # one after the other: never two processes timing at once
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            for name, t in pool.submit(time_in_this_process, case, idle, rounds).result().items():
                times[name] += t
    q, k, v, gqa = _inputs(case)
    result = dict(case, lead=list(case["lead"]))
    result["time"] = {name: min(t) for name, t in times.items()}
    result["median"] = {name: statistics.median(t) for name, t in times.items()}
    result["rounds"] = len(times["auto"])
    chosen = worth_tiling(prepare_attention(q, k, v, None, case["causal"], enable_gqa=gqa))
    result["auto takes"] = "tiled" if chosen else "reference"
    median = result["median"]
    fastest = min(median["reference"], median["tiled"])
    result["auto/faster"] = median["auto"] / fastest
    result["chosen/faster"] = median[result["auto takes"]] / fastest
    return result


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
        f"heads, enable_gqa); medians of {MIN_ROUNDS * PROCESSES} to {MAX_ROUNDS} interleaved rounds "
        f"pooled from {PROCESSES} fresh processes (more for quicker cases). "
        '"chosen/faster" compares the path auto takes with the faster one in the same rounds; '
        '"auto/faster" times auto itself (the same path, plus the decision).',
        "",
        "| case | lead | T | S | d | causal | reference | tiled | auto | auto takes | chosen/faster | auto/faster |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in auto:
        t = r["median"]
        lines.append(
            f"| {r['kind']} | {lead_text(r)} | {r.get('t', r['n'])} | {r['n']} | {r['d']} | "
            f"{'yes' if r['causal'] else 'no'} | {fmt_time(t['reference'])} | "
            f"{fmt_time(t['tiled'])} | {fmt_time(t['auto'])} | {r['auto takes']} | "
            f"{r['chosen/faster']:.2f} | {r['auto/faster']:.2f} |"
        )
    lines += ["", f"- worst auto/faster: {worst:.2f} (target: at most 1.10)"]
    return lines


def run(args, torch, baseline, report) -> None:
    """The section, into ``report["auto"]`` (torch and the baseline take no part)."""
    report["auto"] = []
    for case in auto_cases(args.quick):
        r = run_auto_case(case, args.idle)
        report["auto"].append(r)
        t = r["median"]
        print(
            f"auto grid {case['kind']:16} {lead_text(case):15} T={case['t']:5} S={case['n']:5} "
            f"d={case['d']:3} causal={case['causal']!s:5}: reference "
            f"{fmt_time(t['reference'])}, tiled {fmt_time(t['tiled'])}, auto "
            f"{fmt_time(t['auto'])} ({r['auto takes']}), auto/faster {r['auto/faster']:.2f}",
            flush=True,
        )


def lines(report) -> list[str]:
    """The section's Markdown (nothing if it did not run)."""
    return auto_lines(report["auto"]) if report.get("auto") else []
