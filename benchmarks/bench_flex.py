"""Section "flex": programmable attention with and without a causal block mask.

``sdpa.flex_attention`` at T = S = 4096, 8 heads of width 64, float32, without a mask and with
a causal ``BlockMask`` (which skips the blocks above the diagonal: the causal call should take
at most 0.6 of the time of the unmasked one), against
``scaled_dot_product_attention(is_causal=True)``; and the time ``create_block_mask`` takes.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from bench_common import D, fmt_time, interleaved_times, table

import sdpa
from sdpa import scaled_dot_product_attention

# Interleaved rounds of the programmable-attention case, whose ratio has a target: with the 3
# rounds of repeats_for, causal/none moved between 0.59 and 0.64 from one run to the next.
FLEX_ROUNDS = 11


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


def run(args, torch, baseline, report) -> None:
    """The section, into ``report["flex"]`` (torch and the baseline take no part)."""
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


def lines(report) -> list[str]:
    """The section's Markdown (nothing if it did not run)."""
    return flex_lines(report["flex"]) if report.get("flex") else []
