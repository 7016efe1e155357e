"""Benchmark: sdpa's tiled attention against PyTorch's CPU flash kernel and the textbook formula.

Run with ``make bench`` (or ``.venv/bin/python benchmarks/run.py [--quick]``). Writes
``latest.json`` and ``latest.md`` (``quick.*`` with ``--quick``) into ``_build/bench/`` (not
tracked), or ``--out DIR``; ``--refresh`` (``make bench REFRESH=1``) writes them into
``benchmarks/results/``, the tracked results that the book and the README cite. ``--baseline
REV`` also times the package as it was at git revision ``REV``, interleaved with the rest, so
that a change's effect on speed is measured in one run on one machine. ``--only`` runs some
sections, each a module of this folder that says what it measures:

* ``torch`` (``bench_torch``): the default path against torch and the textbook formula, with
  GFLOP/s, memory and errors;
* ``auto`` (``bench_auto``): the ``implementation="auto"`` grid;
* ``split`` (``bench_split``): where the time goes, on one core;
* ``flex`` (``bench_flex``): ``sdpa.flex_attention`` with and without a causal block mask;
* ``engine`` (``bench_engine``): the speed targets of issue 33, both tiled paths side by side
  with torch at three shapes, each target marked met or not met.

What they share (the machine, the baseline, interleaved timing, tables) is ``bench_common``.
The implementations are timed interleaved, round after round, with a pause between calls:
OpenBLAS and torch worker threads keep spinning for about 0.1 s after a call and slow down
whatever runs next. torch runs on as many threads as sdpa's tiled paths
(``sdpa.threads.default_num_threads``). The 1-minute load average before and after the run is
recorded, because other processes on the machine change every number here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import bench_auto
import bench_engine
import bench_flex
import bench_split
import bench_torch
from bench_common import IDLE, REPO, header_lines, load_baseline, machine

from sdpa.threads import default_num_threads

RESULTS = Path(__file__).resolve().parent / "results"  # tracked: written only with --refresh
DEFAULT_OUT = REPO / "_build" / "bench"  # untracked
# The sections in the order they run and print: name -> module with run(...) and lines(report).
SECTIONS = {
    "torch": bench_torch,
    "auto": bench_auto,
    "split": bench_split,
    "flex": bench_flex,
    "engine": bench_engine,
}


def markdown(report) -> str:
    """The report as Markdown: the header, then each section's lines, in order."""
    lines = header_lines(report)
    for module in SECTIONS.values():
        lines += module.lines(report)
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


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """Validate every argument, and create the output directory, before anything is timed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a shorter run: n in {1024, 2048} (torch, split, flex), small cases (auto), "
        f"{bench_engine.QUICK_ROUNDS} rounds (engine)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help=f"interleaved rounds of the engine section (default {bench_engine.ROUNDS}, "
        f"{bench_engine.QUICK_ROUNDS} with --quick)",
    )
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
    # the sections run in SECTIONS' order, whatever the order of --only
    args.sections = tuple(name for name in SECTIONS if name in (args.only or SECTIONS))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    baseline = load_baseline(args.baseline) if args.baseline else None

    try:
        import torch

        torch.set_num_threads(default_num_threads())
    except ImportError:
        torch = None
        print("torch is not installed: ratios to torch are not measured", file=sys.stderr)

    report = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "machine": machine(),
        "torch": None if torch is None else torch.__version__,
        "torch threads": None if torch is None else torch.get_num_threads(),
        "baseline": args.baseline,
        "sections": list(args.sections),
    }
    load0 = os.getloadavg()[0]
    for name in args.sections:
        SECTIONS[name].run(args, torch, baseline, report)
    report["load"] = [load0, os.getloadavg()[0]]
    stem = "quick" if args.quick else "latest"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"written: {args.out / (stem + '.md')} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
