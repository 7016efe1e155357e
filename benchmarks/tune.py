"""Measurements behind the constants of ``sdpa.tiled``: tile sizes and the ``auto`` threshold.

``.venv/bin/python benchmarks/tune.py [tiles|threshold]``

* ``tiles``: CPU time of one worker thread (``time.thread_time``, BLAS on one thread) for a
  grid of tile sizes at n = 2048, one head of width 64, causal and not. CPU time of a single
  thread is far less sensitive to other processes on a shared machine than wall time.
  Configurations are interleaved round after round; the table shows the best round of each,
  relative to the current default.
* ``threshold``: wall time of ``implementation="reference"`` and ``"tiled"`` (all cores)
  interleaved, for small problems, to place ``sdpa.tiled.MIN_TILED_SCORES``.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

import sdpa
from sdpa import tiled
from sdpa.attention import prepare_attention

rng = np.random.default_rng(0)


def tiles(n=2048, rounds=3):
    grid = {np.float32: [(128, 256), (128, 512), (256, 256), (256, 512), (512, 512), (256, 1024)],
            np.float64: [(64, 512), (128, 256), (128, 512), (256, 256), (256, 512)]}
    for dtype, configs in grid.items():
        default = (tiled.BLOCK_ROWS[np.dtype(dtype)], tiled.BLOCK_K[np.dtype(dtype)])
        for is_causal in (False, True):
            q, k, v = (rng.standard_normal((n, 64)).astype(dtype) for _ in range(3))
            problem = prepare_attention(q, k, v, None, is_causal)
            best = {c: np.inf for c in configs}
            with threadpool_limits(1, user_api="blas"):
                for _ in range(rounds):
                    for c in configs:
                        start = time.thread_time()
                        tiled.attention_tiled(problem, block_q=c[0], block_k=c[1], workers=1)
                        best[c] = min(best[c], time.thread_time() - start)
            ref = best.get(default, min(best.values()))
            print(f"{np.dtype(dtype).name} causal={is_causal}: " + "  ".join(
                f"{c[0]}x{c[1]} {best[c] / ref:.2f}" for c in configs), flush=True)


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
        print(f"H={h} n={n:5} scores={h * n * n:9}: reference {ref * 1e3:7.2f} ms, "
              f"tiled {til * 1e3:7.2f} ms, tiled/reference {til / ref:.2f}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1:] or ["tiles", "threshold"]
    if "tiles" in what:
        tiles()
    if "threshold" in what:
        threshold()
