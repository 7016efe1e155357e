"""The benchmark script's command line and the Makefile targets around it (``bench``, ``serve``).

Nothing is timed here: arguments are validated before any measurement starts, which is what
these tests rely on to stay fast.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--idle", "soon"], "argument --idle: must be a number of seconds; got 'soon'"),
        (["--idle", "nan"], "argument --idle: must be a finite number of seconds >= 0; got nan"),
        (["--refresh", "--out", "x"], "--refresh writes into benchmarks/results/; it cannot"),
        (["--baseline", "no-such-revision"], "--baseline no-such-revision: not a git revision"),
        (["--only", "everything"], "argument --only: invalid choice: 'everything'"),
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


def test_results_table_keeps_the_columns_asked_for(run):
    report = {"results": [dict(dtype="float32", causal=True, batch=[4, 8], n=1024)]}
    assert run.results_table(report, ["dtype", "causal", "B x H", "n"]) == [
        "| dtype | causal | B x H | n |",
        "|---|---|---|---|",
        "| float32 | yes | 4 x 8 | 1024 |",
    ]


def test_results_table_refuses_an_unknown_column(run):
    with pytest.raises(
        ValueError, match=r"headers must be columns of RESULT_COLUMNS .*; got \['speed'\]"
    ):
        run.results_table({"results": []}, ["speed"])


def test_the_flex_section_can_run_alone(run):
    assert run.parse_args(["--only", "flex"]).sections == ("flex",)
    assert "flex" in run.parse_args([]).sections


def test_the_flex_case_is_the_issue_s(run):
    # issue 23: a causal BlockMask at T = S = 4096, B = 1, 8 heads of width 64, float32
    assert run.flex_cases(quick=False) == [dict(batch=(1, 8), n=4096, d=64, dtype="float32")]
    assert [c["n"] for c in run.flex_cases(quick=True)] == [2048]


def test_flex_lines_report_the_ratio_against_its_target(run):
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
    lines = run.flex_lines([result])
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


def test_the_auto_grid_holds_grouped_query_decoding(run):
    # issue 34: 32 and 64 query heads over 8 key heads, T = 1 to 8, S = 512 to 16384
    grouped = [c for c in run.auto_cases(quick=False) if c.get("kv_heads") is not None]
    assert {(c["lead"], c["kv_heads"]) for c in grouped} == {((1, 32), 8), ((1, 64), 8)}
    assert {c["t"] for c in grouped} == {1, 2, 4, 8}
    assert {c["n"] for c in grouped} == {512, 2048, 4096, 16384}
    assert len(grouped) == 2 * 4 * 4
    assert {c["kind"] for c in run.auto_cases(quick=False)} >= {"decoding", "many small heads"}
    quick = [c for c in run.auto_cases(quick=True) if c.get("kv_heads") is not None]
    assert quick and all(c["lead"][1] * c["t"] * c["n"] <= 2**17 for c in quick)
    assert run.lead_text(grouped[0]) == "(1, 32 over 8)"
    assert run.lead_text(dict(lead=[4, 8])) == "(4, 8)"
