"""The benchmark script's command line, its sections and the Makefile targets around it.

``benchmarks/run.py`` is a driver over one module per section (``bench_torch``, ``bench_auto``,
``bench_split``, ``bench_flex``, ``bench_engine``) and ``bench_common``. Nothing is timed here:
arguments are validated before any measurement starts, the tables are built from hand-made
results, and the engine's variants run once on a tiny input to check that they compute
attention.
"""

from __future__ import annotations

import inspect
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "benchmarks" / "run.py"


@pytest.fixture(scope="module")
def run():
    sys.path.insert(0, str(RUN.parent))
    try:
        import run
    finally:
        sys.path.remove(str(RUN.parent))
    return run


@pytest.fixture(scope="module")
def sections(run):
    """The section modules by name, as the driver runs them."""
    return run.SECTIONS


@pytest.mark.parametrize(
    "args, message",
    [
        (["--idle", "soon"], "argument --idle: must be a number of seconds; got 'soon'"),
        (["--idle", "nan"], "argument --idle: must be a finite number of seconds >= 0; got nan"),
        (["--refresh", "--out", "x"], "--refresh writes into benchmarks/results/; it cannot"),
        (["--baseline", "no-such-revision"], "--baseline no-such-revision: not a git revision"),
        (["--only", "everything"], "argument --only: invalid choice: 'everything'"),
        (["--rounds", "0"], "argument --rounds: must be a whole number >= 1; got 0"),
        (["--rounds", "many"], "argument --rounds: must be a whole number >= 1; got 'many'"),
    ],
)
def test_bad_arguments_are_refused(run, capsys, args, message):
    with pytest.raises(SystemExit, match="^2$"):  # argparse's exit status for usage errors
        run.parse_args(args)
    assert message in capsys.readouterr().err


def test_bad_arguments_stop_the_script_before_anything_runs():
    result = subprocess.run(
        [sys.executable, str(RUN), "--idle", "-1"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "argument --idle: must be a finite number of seconds >= 0; got -1" in result.stderr
    assert result.stdout == ""  # nothing was measured


def test_out_is_created_first_and_must_be_a_directory(run, capsys, tmp_path):
    args = run.parse_args(["--out", str(tmp_path / "new" / "results")])
    assert args.out.is_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="^2$"):
        run.parse_args(["--out", str(blocker / "results")])
    assert (
        f"--out {blocker / 'results'}: cannot create or write this directory"
        in capsys.readouterr().err
    )


def test_default_output_is_untracked(run):
    # `make bench` must not overwrite the tracked results unless asked (REFRESH=1)
    args = run.parse_args([])
    assert args.out == REPO / "_build" / "bench"
    assert run.parse_args(["--refresh"]).out == REPO / "benchmarks" / "results"
    # git ignores it: .gitignore names the build folder (read directly, so that the check also
    # runs in the unpacked source archive, which has no .git)
    patterns = (REPO / ".gitignore").read_text(encoding="utf-8").split()
    assert "_build/" in patterns or "_build" in patterns
    if (REPO / ".git").exists():
        ignored = subprocess.run(
            ["git", "-C", str(REPO), "check-ignore", "-q", "_build/bench/latest.md"], check=False
        )
        assert ignored.returncode == 0


def test_make_bench_pins_torch_and_writes_to_build():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(
        ["make", "-n", "bench", "VPY=python"], cwd=REPO, capture_output=True, text=True
    ).stdout
    assert '"torch==2.13.0"' in dry  # installed at the pin ...
    assert "sys.exit(torch.__version__.split('+')[0] != '2.13.0')" in dry  # ... unless there
    assert "benchmarks/run.py --out _build/bench" in dry
    dry = subprocess.run(
        ["make", "-n", "bench", "REFRESH=1", "VPY=python"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    assert "benchmarks/run.py --refresh" in dry


def test_make_serve_on_a_busy_port_prints_one_clear_line(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    (tmp_path / "html").mkdir()
    (tmp_path / "html" / "index.html").write_text("<html></html>")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                "make",
                "-s",
                "serve",
                f"PORT={port}",
                f"BUILDDIR={tmp_path}",
                f"PYTHON={sys.executable}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    assert (
        f"cannot serve on http://127.0.0.1:{port}/ (OSError: [Errno 98] Address already in use)"
        in result.stdout
    )


def test_results_table_keeps_the_columns_asked_for(sections):
    report = {"results": [dict(dtype="float32", causal=True, batch=[4, 8], n=1024)]}
    assert sections["torch"].results_table(report, ["dtype", "causal", "B x H", "n"]) == [
        "| dtype | causal | B x H | n |",
        "|---|---|---|---|",
        "| float32 | yes | 4 x 8 | 1024 |",
    ]


def test_results_table_refuses_an_unknown_column(sections):
    with pytest.raises(
        ValueError, match=r"headers must be columns of RESULT_COLUMNS .*; got \['speed'\]"
    ):
        sections["torch"].results_table({"results": []}, ["speed"])


def test_the_flex_section_can_run_alone(run):
    assert run.parse_args(["--only", "flex"]).sections == ("flex",)
    assert "flex" in run.parse_args([]).sections


def test_the_flex_case_is_the_issue_s(sections):
    # issue 23: a causal BlockMask at T = S = 4096, B = 1, 8 heads of width 64, float32
    assert sections["flex"].flex_cases(quick=False) == [
        dict(batch=(1, 8), n=4096, d=64, dtype="float32")
    ]
    assert [c["n"] for c in sections["flex"].flex_cases(quick=True)] == [2048]


def test_flex_lines_report_the_ratio_against_its_target(run, sections):
    result = dict(
        dtype="float32",
        batch=[1, 8],
        n=4096,
        time={"flex, no mask": 0.8, "flex, causal block mask": 0.44, "sdpa, is_causal": 0.4},
        **{"causal/none": 0.55, "first call/none": 0.58, "causal/sdpa causal": 1.1},
        sparsity=48.4375,
        create_block_mask=0.012,
        **{"max difference": 3e-7},
    )
    lines = sections["flex"].flex_lines([result])
    assert (
        "| float32 | 1 x 8 | 4096 | 800.0 ms | 440.0 ms | 400.0 ms | 0.55 | 0.58 | 1.10 | 48.4 "
        "| 12.0 ms | 3.0e-07 |" in lines
    )
    assert lines[-2:] == [
        "- worst causal/none: 0.55 (target: at most 0.60)",
        "- worst first call/none: 0.58",
    ]
    assert "## Programmable attention" in run.markdown(
        dict(quick=False, date="d", machine=dict(cpu="c", cores=2, python="3", numpy="2", sdpa="0"),
             load=[0.0, 0.0], flex=[result])
    )  # fmt: skip


def test_an_auto_case_pools_the_rounds_of_fresh_processes(sections, monkeypatch):
    # The rounds come from PROCESSES processes (spawned: they import bench_auto from the path)
    # and the ratios from the medians of all of them.
    monkeypatch.syspath_prepend(str(RUN.parent))
    auto = sections["auto"]
    case = dict(kind="t", lead=(2,), t=8, n=16, d=8, causal=False, dtype="float32")
    r = auto.run_auto_case(case, 0.0, rounds=3)
    assert r["rounds"] >= 3 * auto.PROCESSES and r["rounds"] % auto.PROCESSES == 0
    assert r["auto takes"] == "reference"  # 256 scores: far below the tiling threshold
    median = r["median"]
    assert r["auto/faster"] == median["auto"] / min(median["reference"], median["tiled"])
    assert r["chosen/faster"] == median["reference"] / min(median["reference"], median["tiled"])


def test_the_auto_grid_holds_grouped_query_decoding(sections):
    auto = sections["auto"]
    # issue 34: 32 and 64 query heads over 8 key heads, T = 1 to 8, S = 512 to 16384
    grouped = [c for c in auto.auto_cases(quick=False) if c.get("kv_heads") is not None]
    assert {(c["lead"], c["kv_heads"]) for c in grouped} == {((1, 32), 8), ((1, 64), 8)}
    assert {c["t"] for c in grouped} == {1, 2, 4, 8}
    assert {c["n"] for c in grouped} == {512, 2048, 4096, 16384}
    assert len(grouped) == 2 * 4 * 4
    assert {c["kind"] for c in auto.auto_cases(quick=False)} >= {"decoding", "many small heads"}
    quick = [c for c in auto.auto_cases(quick=True) if c.get("kv_heads") is not None]
    assert quick and all(c["lead"][1] * c["t"] * c["n"] <= 2**17 for c in quick)
    assert auto.lead_text(grouped[0]) == "(1, 32 over 8)"
    assert auto.lead_text(dict(lead=[4, 8])) == "(4, 8)"


# -- the layout: a driver and one module per section ----------------------------------------


def test_each_section_is_a_module_of_its_own(run, sections):
    assert list(sections) == ["torch", "auto", "split", "flex", "engine"]  # the running order
    for name, module in sections.items():
        assert Path(module.__file__) == RUN.parent / f"bench_{name}.py"
        assert callable(module.run) and callable(module.lines)
        assert module.lines({}) == []  # a section that did not run prints nothing
    # the driver defines no measurement of its own, and every file stays a readable size
    defined = {
        name
        for name, value in vars(run).items()
        if inspect.isfunction(value) and value.__module__ == "run"
    }
    assert defined == {"markdown", "seconds", "positive_int", "parse_args", "main"}
    for path in RUN.parent.glob("*.py"):
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 800, path.name


def test_sections_run_in_their_order_whatever_the_order_of_only(run):
    args = run.parse_args(["--only", "engine", "--only", "torch"])
    assert args.sections == ("torch", "engine")
    assert run.parse_args([]).sections == ("torch", "auto", "split", "flex", "engine")
    assert run.parse_args(["--rounds", "3"]).rounds == 3
    assert run.parse_args([]).rounds is None  # the section's own default


def test_rotated_turns_the_order_by_one_each_round(sections):
    rotated = sys.modules["bench_common"].rotated
    impls = dict(a=1, b=2, c=3)
    orders = ["".join(name for name, _ in rotated(impls, i)) for i in range(4)]
    assert orders == ["abc", "bca", "cab", "abc"]


# -- the engine section (issue 33) -------------------------------------------------------


def test_the_engine_shapes_and_targets_are_the_issue_s(sections):
    engine = sections["engine"]
    assert engine.SHAPES == [(4, 8, 1024), (1, 8, 4096), (1, 32, 2048)]
    assert (engine.DTYPE, engine.D) == ("float32", 64)
    assert dict(engine.TARGETS) == {
        "flex/dense unmasked": 1.05,
        "dense causal/unmasked": 0.6,
        "flex causal/unmasked": 0.6,
        "ours/torch unmasked": 1.2,
        "ours/torch causal": 1.15,
    }
    assert engine.BASELINE_SLACK == 1.03
    assert engine.QUICK_ROUNDS < engine.ROUNDS


def test_the_engine_variants_compute_attention(sections, rng):
    # one call each on a tiny input (no timing): the four variants against a float64 formula
    engine = sections["engine"]
    import sdpa

    q, k, v = (rng.standard_normal((1, 2, 7, 4)).astype(np.float32) for _ in range(3))
    impls = engine.package_variants(sdpa, q, k, v)
    assert list(impls) == list(engine.VARIANTS)
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / 2.0  # sqrt(Dk) = 2
    for name, f in impls.items():
        s = (
            np.where(np.tril(np.ones((7, 7), bool)), scores, -np.inf)
            if "causal" in name
            else scores
        )
        weights = np.exp(s - s.max(-1, keepdims=True))
        expected = weights / weights.sum(-1, keepdims=True) @ v
        np.testing.assert_allclose(f(), expected, rtol=1e-5, atol=1e-6, err_msg=name)
    prefixed = engine.package_variants(sdpa, q, k, v, prefix="baseline ")
    assert list(prefixed) == [f"baseline {name}" for name in engine.VARIANTS]


def test_products_alone_multiply_every_score_once_in_both_products(sections, monkeypatch):
    # The floor does the dense unmasked call's products: 2 T S Dk + 2 T S Dv flops per head, on
    # the engine's tiles (here T = 1100 and S = 700: blocks of rows and keys with a short last one)
    engine = sections["engine"]
    flops, shapes = [], set()

    def counting_matmul(a, b, out):
        flops.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
        shapes.add((a.shape, b.shape))
        return np.matmul(a, b, out=out)

    shape = (1, 3, 1100, 16)
    q = np.ones(shape, np.float32)
    k, v = np.ones((1, 3, 700, 16), np.float32), np.ones((1, 3, 700, 8), np.float32)
    call = engine.products_alone(q, k, v, threads=2)
    monkeypatch.setattr(engine, "np", SimpleNamespace(empty=np.empty, matmul=counting_matmul))
    call()
    assert sum(flops) == 3 * (2 * 1100 * 700 * 16 + 2 * 1100 * 700 * 8)
    # the engine's own tiles for this call
    from sdpa.problem import prepare_attention
    from sdpa.tiles.band import tile_plan_sizes

    _, block_q, block_k = tile_plan_sizes(prepare_attention(q, k, v), num_threads=2)
    assert max(a[0] for a, _ in shapes) == block_q and max(b[1] for _, b in shapes) == block_k
    with pytest.raises(ValueError, match="a head per thread"):
        engine.products_alone(q, k, v, threads=4)


def engine_row(times, shape=(1, 8, 4096)):
    """A result row as run_shape makes it, from hand-set times (seconds)."""
    engine = sys.modules["bench_engine"]
    return dict(
        batch=list(shape[:2]), n=shape[2], d=64, dtype="float32", rounds=5, time=times,
        ratio=engine.ratios(times), difference=2e-6,
    )  # fmt: skip


MACHINE = dict(cpu="Some CPU", cores=2, simd="AVX2, AVX-512", numpy="2.0", blas="openblas 0.3")
TIMES = {"dense": 0.100, "flex": 0.104, "dense causal": 0.055, "flex causal": 0.070}
TIMES_TORCH = {**TIMES, "torch": 0.090, "torch causal": 0.050, "products alone": 0.080}


def test_engine_ratios_are_the_issue_s(sections):
    ratio = sections["engine"].ratios(TIMES_TORCH)
    expected = {
        "flex/dense unmasked": 0.104 / 0.100,
        "dense causal/unmasked": 0.055 / 0.100,
        "flex causal/unmasked": 0.070 / 0.104,
        "ours/torch unmasked": 0.100 / 0.090,  # the faster of dense and flex
        "ours/torch causal": 0.055 / 0.050,
        "products alone/torch": 0.080 / 0.090,
    }
    assert ratio.keys() == expected.keys()
    np.testing.assert_allclose([ratio[k] for k in expected], list(expected.values()), rtol=1e-12)


def test_engine_lines_state_the_machine_and_each_target(sections):
    engine = dict(rows=[engine_row(TIMES_TORCH)], threads=dict(sdpa=2, torch=2), torch="2.13.0+cpu")
    lines = sections["engine"].lines(dict(engine=engine, machine=MACHINE))
    text = "\n".join(lines)
    for fact in ("Some CPU", "AVX2, AVX-512", "openblas 0.3", "sdpa on 2 threads",
                 "torch 2.13.0+cpu (CPU) on 2 threads", "median of 5 interleaved rounds"):  # fmt: skip
        assert fact in text
    assert (
        "| 1 x 8 x 4096 | 100.0 ms | 104.0 ms | 1.04 | 0.55 | 0.67 | 90.0 ms | 50.0 ms | 1.11 "
        "| 1.10 | 80.0 ms | 0.89 | 2.0e-06 |" in lines
    )
    assert lines[-1].startswith("- products alone: the matrix products of the dense unmasked")
    assert lines[-6:-1] == [
        "- flex/dense unmasked at most 1.05: met; worst 1.04 at 1 x 8 x 4096",
        "- dense causal/unmasked at most 0.6: met; worst 0.55 at 1 x 8 x 4096",
        "- flex causal/unmasked at most 0.6: not met (1 of 1 shapes over); worst 0.67 at 1 x 8 x 4096",
        "- ours/torch unmasked at most 1.2: met; worst 1.11 at 1 x 8 x 4096",
        "- ours/torch causal at most 1.15: met; worst 1.10 at 1 x 8 x 4096",
    ]


def test_engine_lines_without_torch_say_so(sections):
    engine = dict(rows=[engine_row(TIMES)], threads=dict(sdpa=2, torch=None), torch=None)
    lines = sections["engine"].lines(dict(engine=engine, machine=MACHINE))
    assert any(
        "torch is not installed: its columns and targets are not measured" in x for x in lines
    )
    assert "- ours/torch causal at most 1.15: not measured" in lines
    assert "| 1 x 8 x 4096 | 100.0 ms | 104.0 ms | 1.04 | 0.55 | 0.67 | n/a | n/a | n/a | n/a " \
        "| n/a | n/a | 2.0e-06 |" in lines  # fmt: skip


def test_engine_lines_hold_the_baseline_against_three_percent(sections):
    times = {**TIMES_TORCH, **{f"baseline {k}": t for k, t in TIMES.items()}}
    times["baseline dense"] = 0.096  # ours 0.100: 4 % slower than the baseline
    engine = dict(rows=[engine_row(times)], threads=dict(sdpa=2, torch=2), torch="2.13.0")
    lines = sections["engine"].lines(dict(engine=engine, machine=MACHINE))
    assert "| 1 x 8 x 4096 | 1.042 | 1.000 | 1.000 | 1.000 |" in lines
    assert "- ours/baseline dense at most 1.03: not met (1 of 1 shapes over); worst 1.04 at " \
        "1 x 8 x 4096" in lines  # fmt: skip
    assert "- ours/baseline flex causal at most 1.03: met; worst 1.00 at 1 x 8 x 4096" in lines


def test_the_torch_grid_holds_the_baseline_against_three_percent(sections):
    verdict = sections["torch"].baseline_verdict
    assert verdict([dict(ours_over_baseline=1.02), dict(ours_over_baseline=0.9)]) == (
        "- worst ours/baseline: 1.020 (target: at most 1.03: met)"
    )
    assert verdict([dict(ours_over_baseline=1.05)]).endswith("not met)")
    assert verdict([dict()]) == "- worst ours/baseline: not measured"


def test_the_machine_names_its_vector_extensions_and_threads():
    common = sys.modules["bench_common"]
    info = common.machine()
    assert info["simd"] == common.simd()
    assert any(word in info["simd"] for word in ("AVX", "neither", "unknown"))
    assert info["sdpa threads"] >= 1
