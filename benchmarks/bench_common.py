"""What the benchmarks of ``run.py`` share: the machine, the baseline, timing and tables.

Each section (``bench_torch``, ``bench_auto``, ``bench_split``, ``bench_flex``,
``bench_engine``) imports from here; ``run.py`` is the command line that runs them.
"""

from __future__ import annotations

import importlib.util
import io
import math
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

import sdpa
from sdpa.threads import default_num_threads

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
D = 64  # the head width of every case unless stated
IDLE = 0.15  # seconds between timed calls
# Issue 33: no case slower than the baseline revision by more than 3 % (ours/baseline at most).
BASELINE_SLACK = 1.03


def simd() -> str:
    """The vector extensions NumPy and torch can use here: AVX2, AVX-512 (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    found = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f")) if flag in flags]
    return ", ".join(found) or "neither AVX2 nor AVX-512"


def machine() -> dict:
    """The CPU, its cores and vector extensions, NumPy's BLAS, the versions."""
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
        "simd": simd(),
        "sdpa threads": default_num_threads(),
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


def rotated(impls: dict, i: int) -> list:
    """Round ``i``'s order: the list rotated by ``i``, so that over ``len(impls)`` rounds each
    implementation runs once in every position, after each of the others' predecessors."""
    items = list(impls.items())
    shift = i % len(items) if items else 0
    return items[shift:] + items[:shift]


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


def geomean(xs):
    xs = [x for x in xs if x is not None]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def fmt_time(t):
    return f"{t * 1e3:.1f} ms" if t < 10 else f"{t:.1f} s"


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def header_lines(report) -> list[str]:
    """Title, date, machine, software and load."""
    m = report["machine"]
    lines = [
        f"# Benchmark results ({'quick' if report['quick'] else 'full'} run)",
        "",
        f"- date: {report['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores ({m.get('simd', 'SIMD unknown')}); "
        f"{m.get('blas', 'BLAS unknown')}; "
        f"OPENBLAS_CORETYPE={m.get('OPENBLAS_CORETYPE', 'unset')}",
        f"- software: Python {m['python']}, NumPy {m['numpy']}, "
        f"torch {report.get('torch', 'absent')}, sdpa {m['sdpa']}",
        f"- threads: sdpa {m.get('sdpa threads', 'n/a')}, torch {report.get('torch threads', 'n/a')}",
        f"- load average (1 min) before / after: {report['load'][0]:.2f} / {report['load'][1]:.2f}",
    ]
    if report.get("baseline"):
        lines.append(f"- baseline: sdpa at git revision {report['baseline']}, timed interleaved")
    return lines
