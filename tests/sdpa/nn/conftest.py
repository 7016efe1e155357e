"""The inputs the tests of sdpa.nn's functions share (test_functional, test_losses,
test_softcap)."""

from __future__ import annotations

import pytest
from nn_checks import LEAD, OUT, E, V


@pytest.fixture
def data(rng):
    """float64 inputs of every function, with a cotangent for each result."""
    x = rng.standard_normal((*LEAD, E))
    return dict(
        x=x,
        weight=rng.standard_normal((E, OUT)),
        bias=rng.standard_normal(OUT),
        d_linear=rng.standard_normal((*LEAD, OUT)),
        gain=1.0 + 0.3 * rng.standard_normal(E),
        shift=rng.standard_normal(E),
        d_x=rng.standard_normal((*LEAD, E)),
        logits=3.0 * rng.standard_normal((*LEAD, V)),
        targets=rng.integers(0, V, size=LEAD),
    )
