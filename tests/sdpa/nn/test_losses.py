"""sdpa.nn.losses: cross_entropy, its backward pass and embedding_backward, checked against
hand-computed values, central finite differences (float64), torch.nn.functional's cross_entropy
and embedding with torch.autograd (float64 to 1e-10, float32 to 1e-5), and for the error of every
``raise``.

Every dimension is a different size (leading (2, 3), E = 5, V = 11) so that a swapped axis cannot
pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from nn_checks import F32, F64, FD, E, V, central_differences, readonly

from sdpa import nn

# ---------------------------------------------------------------------------------------------
# Forward: hand-computed values and torch
# ---------------------------------------------------------------------------------------------


def test_cross_entropy_hand_computed():
    # row 0: log(1 + e + e^2) - 2 for target 2; row 1 ignored; row 2: log 3 for equal logits
    logits = np.array([[0.0, 1.0, 2.0], [5.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    expected = (math.log(1 + math.e + math.e**2) - 2 + math.log(3)) / 2
    loss = nn.cross_entropy(logits, np.array([2, 7, 0]), ignore_index=7)
    assert isinstance(loss, float)
    assert loss == pytest.approx(expected, rel=1e-15)


def test_cross_entropy_large_logits_do_not_overflow():
    loss = nn.cross_entropy(np.array([[1000.0, 0.0]]), np.array([1]))
    assert loss == pytest.approx(1000.0, rel=1e-15)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_matches_torch(torch, data, dtype):
    logits = data["logits"].astype(dtype)
    tol = F64 if dtype == np.float64 else F32
    ce = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits).reshape(-1, V), torch.from_numpy(data["targets"]).reshape(-1)
    )
    assert nn.cross_entropy(logits, data["targets"]) == pytest.approx(
        ce.item(), rel=tol["rtol"], abs=tol["atol"]
    )


# ---------------------------------------------------------------------------------------------
# Backward: central differences (float64) and torch.autograd (float64 and float32)
# ---------------------------------------------------------------------------------------------


def test_cross_entropy_backward_matches_central_differences(data):
    targets = data["targets"].copy()
    targets[0, 1] = -1  # one ignored row
    grad = nn.cross_entropy_backward(data["logits"], targets, ignore_index=-1)
    numeric = central_differences(
        lambda z: nn.cross_entropy(z, targets, ignore_index=-1), (data["logits"],), 1.0, 0
    )
    np.testing.assert_allclose(grad, numeric, **FD)
    np.testing.assert_array_equal(grad[0, 1], 0.0)


def test_embedding_backward_matches_central_differences(rng):
    table = rng.standard_normal((V, E))
    indices = np.array([[3, 1, 3], [0, 3, 10]])  # token 3 three times; most rows unused
    d_out = rng.standard_normal((2, 3, E))
    numeric = central_differences(lambda t: t[indices], (table,), d_out, 0)
    np.testing.assert_allclose(nn.embedding_backward(d_out, indices, V), numeric, **FD)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("ignore_index", [None, -100, 4])
def test_cross_entropy_backward_matches_torch(torch, data, dtype, ignore_index):
    logits = data["logits"].astype(dtype)
    targets = data["targets"].copy()
    if ignore_index is not None:
        targets[1, ::2] = ignore_index
    z = torch.tensor(logits, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(
        z.reshape(-1, V),
        torch.tensor(targets).reshape(-1),
        ignore_index=-100 if ignore_index is None else ignore_index,
    )
    loss.backward()
    tol = F64 if dtype == np.float64 else F32
    ours = nn.cross_entropy_backward(logits, targets, ignore_index=ignore_index)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, z.grad.numpy(), **tol)
    assert nn.cross_entropy(logits, targets, ignore_index=ignore_index) == pytest.approx(
        loss.item(), rel=tol["rtol"]
    )


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_embedding_backward_matches_torch(torch, rng, dtype):
    indices = np.array([[3, 1, 3], [0, 3, 10]])
    d_out = rng.standard_normal((2, 3, E)).astype(dtype)
    table = torch.zeros((V, E), dtype=getattr(torch, np.dtype(dtype).name), requires_grad=True)
    (
        torch.nn.functional.embedding(torch.tensor(indices), table) * torch.tensor(d_out)
    ).sum().backward()
    ours = nn.embedding_backward(d_out, indices, V)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, table.grad.numpy(), **(F64 if dtype == np.float64 else F32))


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


def test_cross_entropy_backward_rows_sum_to_zero(data):
    grad = nn.cross_entropy_backward(data["logits"], data["targets"])
    np.testing.assert_allclose(grad.sum(axis=-1), 0.0, atol=1e-15)


def test_inputs_are_never_modified(data):
    """The losses run on read-only inputs (a write would raise) and leave them equal."""
    d_x, z, targets = readonly(data["d_x"], data["logits"], data["targets"])
    before = [a.copy() for a in (d_x, z, targets)]
    nn.cross_entropy(z, targets), nn.cross_entropy_backward(z, targets)
    nn.embedding_backward(d_x, targets, V)
    for a, b0 in zip((d_x, z, targets), before):
        np.testing.assert_array_equal(a, b0)


# ---------------------------------------------------------------------------------------------
# Errors: one test per raise, each matching its message
# ---------------------------------------------------------------------------------------------


def test_targets_must_be_integers():
    with pytest.raises(TypeError, match="targets must be an integer array; got dtype float64"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0.0, 1.0]))


def test_targets_shape():
    with pytest.raises(
        ValueError, match=r"targets must have shape \(2,\); got targets.shape=\(3,\)"
    ):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0, 1, 2]))


def test_targets_range():
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 3\); got the value 3"):
        nn.cross_entropy_backward(np.zeros((2, 3)), np.array([0, 3]))


def test_ignore_index_must_be_integer():
    with pytest.raises(TypeError, match="ignore_index must be an integer or None; got 1.0"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0, 1]), ignore_index=1.0)


def test_all_targets_ignored():
    with pytest.raises(ValueError, match="every target equals ignore_index=-1"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([-1, -1]), ignore_index=-1)


def test_num_embeddings_must_be_an_integer():
    with pytest.raises(TypeError, match="num_embeddings must be a non-negative integer; got 4.0"):
        nn.embedding_backward(np.ones((2, 3)), np.array([0, 1]), 4.0)


def test_num_embeddings_must_not_be_negative():
    with pytest.raises(ValueError, match="num_embeddings must be a non-negative integer; got -1"):
        nn.embedding_backward(np.ones((2, 3)), np.array([0, 1]), -1)


def test_embedding_d_out_needs_an_axis():
    with pytest.raises(ValueError, match=r"d_out must have at least one dimension \(..., E\)"):
        nn.embedding_backward(np.float64(1.0), np.array(0), 4)
