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
    with pytest.raises(SystemExit) as stop:
        run.parse_args(args)
    assert stop.value.code == 2
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
    with pytest.raises(SystemExit):
        run.parse_args(["--out", str(blocker / "results")])
    assert (f"--out {blocker / 'results'}: cannot create or write this directory"
            in capsys.readouterr().err)


def test_default_output_is_untracked(run):
    # `make bench` must not overwrite the tracked results unless asked (REFRESH=1)
    args = run.parse_args([])
    assert args.out == REPO / "_build" / "bench"
    assert run.parse_args(["--refresh"]).out == REPO / "benchmarks" / "results"
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "-q", "_build/bench/latest.md"], check=False
    )
    assert ignored.returncode == 0  # git ignores it


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
        ["make", "-n", "bench", "REFRESH=1", "VPY=python"], cwd=REPO, capture_output=True,
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
            ["make", "-s", "serve", f"PORT={port}", f"BUILDDIR={tmp_path}",
             f"PYTHON={sys.executable}"],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    assert (
        f"cannot serve on http://127.0.0.1:{port}/ (OSError: [Errno 98] Address already in use)"
        in result.stdout
    )
