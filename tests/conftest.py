"""Shared fixtures: a seeded generator, and PyTorch as an optional reference."""

from __future__ import annotations

import os

import numpy as np
import pytest

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
        reason = "PyTorch is not installed; `pip install torch==2.13.0` to run the conformance tests"
        if REQUIRE_REFERENCES:
            pytest.fail(reason)
        pytest.skip(reason)
    torch.set_num_threads(2)
    return torch


@pytest.fixture(scope="session")
def torch():
    return import_torch()
