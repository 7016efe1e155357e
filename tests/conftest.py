"""Shared fixtures: a seeded generator, PyTorch as an optional reference, the torch marker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

# No per-example deadline: speed is measured in the benchmarks, never asserted in a test, and the
# tests share the machine with a book build (`make test` runs the source-archive build beside them).
settings.register_profile("sdpa", deadline=None)
settings.load_profile("sdpa")

# tests/references.py, the independent references, is imported by the tests as `references`
# (the tests live in subfolders; their shared helper modules here); tests/book/test_site_widgets.py
# imports the browser test's setup as `test_site_browser`.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent / "book"))

# .ci/run sets this: there, a missing reference implementation is a failure, not a skip.
REQUIRE_REFERENCES = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261121)


def import_torch():
    """Return torch, or skip (fail under SDPA_REQUIRE_REFERENCES=1) with the reason."""
    try:
        import torch
    except ImportError:
        reason = (
            "PyTorch is not installed; `pip install torch==2.13.0` to run the conformance tests"
        )
        if REQUIRE_REFERENCES:
            pytest.fail(reason)
        pytest.skip(reason)
    torch.set_num_threads(2)
    return torch


@pytest.fixture(scope="session")
def torch():
    return import_torch()


def _uses_torch(item) -> bool:
    """Whether a test reaches PyTorch: through the ``torch`` fixture or by importing it."""
    if "torch" in getattr(item, "fixturenames", ()):
        return True
    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    return code is not None and ("import_torch" in code.co_names or "torch" in code.co_names)


def pytest_collection_modifyitems(config, items):
    # The torch marker follows from the code, so that no test that uses PyTorch can lack it.
    for item in items:
        if _uses_torch(item) and item.get_closest_marker("torch") is None:
            item.add_marker(pytest.mark.torch)
