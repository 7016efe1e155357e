"""Tests of ``python -m sdpa`` (sdpa.__main__) and its console script ``sdpa-demo``."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import sdpa
from sdpa.__main__ import main

SRC = Path(sdpa.__file__).resolve().parents[1]
PYPROJECT = SRC.parent / "pyproject.toml"
HEADERS = (
    "1. Simple attention",
    "2. Causal attention",
    "3. Batched attention",
    "4. Multi-head attention",
    "5. A sentence",
)


@pytest.fixture(scope="module")
def demo_output() -> str:
    """stdout of ``python -m sdpa`` in a fresh interpreter, on this checkout's package."""
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "sdpa"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def matrix_after(text: str, marker: str, n_rows: int) -> np.ndarray:
    """The numbers of the ``n_rows`` lines printed after the header line that follows ``marker``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line) + 2  # skip the column labels
    return np.array(
        [[float(x) for x in line.split()[1:]] for line in lines[start : start + n_rows]]
    )


def test_module_prints_the_five_demos_in_order(demo_output):
    positions = [demo_output.index(h) for h in HEADERS]
    assert positions == sorted(positions)


def test_module_prints_the_cat_numbers(demo_output):
    assert "[0.788 1.576]" in demo_output
    cat_row = next(line for line in demo_output.splitlines() if line.split()[:1] == ["cat"])
    np.testing.assert_allclose([float(x) for x in cat_row.split()[1:]], [0.212, 0.212, 0.576])


def test_module_prints_shapes(demo_output):
    assert "query (3, 4), key (3, 4), value (3, 4) -> out (3, 4)" in demo_output
    assert "query (2, 5, 8) -> out (2, 5, 8), weights (2, 5, 5)" in demo_output
    assert "x (1, 6, 16) -> out (1, 6, 16), per-head weights (1, 4, 6, 6)" in demo_output


def test_printed_weights_are_what_they_claim(demo_output):
    simple = matrix_after(demo_output, "weights (each row sums to 1)", 3)
    np.testing.assert_allclose(simple.sum(axis=1), 1.0, atol=2e-3)  # rounded to 3 decimals
    causal = matrix_after(demo_output, "weights (zero above the diagonal)", 4)
    np.testing.assert_array_equal(np.triu(causal, 1), 0.0)
    np.testing.assert_allclose(causal.sum(axis=1), 1.0, atol=2e-3)
    padded = matrix_after(demo_output, "weights of sequence 1", 5)
    np.testing.assert_array_equal(padded[:, 3:], 0.0)


def test_main_in_process_matches_the_module(demo_output, capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == demo_output


def test_seed_changes_the_random_demos_but_not_the_sentence(capsys):
    main(["--seed", "1"])
    other = capsys.readouterr().out
    main(["--seed", "0"])
    default = capsys.readouterr().out
    assert other != default
    sentence = lambda text: text[text.index(HEADERS[-1]) :]  # noqa: E731
    assert sentence(other) == sentence(default)


def test_help(capsys):
    with pytest.raises(SystemExit, match="^0$"):
        main(["--help"])
    assert "--seed" in capsys.readouterr().out


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit, match="^2$"):
        main(["--seed", "x"])
    assert "invalid int value" in capsys.readouterr().err


def test_console_script_is_declared():
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    assert scripts["sdpa-demo"] == "sdpa.__main__:main"


def test_console_script_entry_point_loads_main():
    try:
        eps = importlib.metadata.entry_points(group="console_scripts", name="sdpa-demo")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        pytest.skip("sdpa is not installed, so it has no entry points (pip install -e .)")
    if not eps:
        pytest.skip("sdpa is not installed, so it has no entry points (pip install -e .)")
    (ep,) = eps
    assert ep.value == "sdpa.__main__:main"
    assert ep.load() is main
