"""sdpa.nn.optim: AdamW against torch.optim.AdamW over 20 steps with a change of learning rate
(float64 to 1e-10, float32 to 1e-5), a hand-computed first step, updates in place, and the error
of every ``raise``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from nn_checks import F32, F64, OUT, E, V, readonly

from sdpa import nn


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_adamw_matches_torch_over_20_steps(torch, rng, dtype):
    shapes = {"w": (E, OUT), "b": (OUT,), "table": (V, 3)}
    params = {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}
    grads = [
        {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}
        for _ in range(20)
    ]
    tensors = {name: torch.tensor(p.copy(), requires_grad=True) for name, p in params.items()}
    hyper = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours = nn.AdamW(params, **hyper)
    theirs = torch.optim.AdamW(list(tensors.values()), **hyper)
    tol = F64 if dtype == np.float64 else F32
    for step, g in enumerate(grads):
        if step == 10:  # a learning-rate schedule changes lr between steps
            ours.lr = theirs.param_groups[0]["lr"] = 1e-2
        for name, t in tensors.items():
            t.grad = torch.tensor(g[name])
        theirs.step()
        ours.step(g)
        for name, t in tensors.items():
            assert params[name].dtype == dtype
            np.testing.assert_allclose(
                params[name], t.detach().numpy(), **tol, err_msg=f"{name} after step {step + 1}"
            )
    assert ours.step_count == 20


def test_adamw_first_step_hand_computed():
    # step 1: m = (1 - b1) g, v = (1 - b2) g^2, so m / (1 - b1) / sqrt(v / (1 - b2)) = sign(g)
    params = {"w": np.array([1.0, -2.0])}
    opt = nn.AdamW(params, lr=0.1, eps=0.0, weight_decay=0.5)
    opt.step({"w": np.array([3.0, -0.001])})
    np.testing.assert_allclose(params["w"], [1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1], rtol=1e-14)


def test_adamw_updates_the_arrays_in_place():
    w = np.zeros(3)
    params = {"w": w}
    nn.AdamW(params, lr=0.5).step({"w": np.ones(3)})
    assert params["w"] is w
    np.testing.assert_allclose(w, -0.5, rtol=1e-7)


def test_adamw_params_must_be_a_dict():
    with pytest.raises(TypeError, match="params must be a dict of named NumPy arrays; got list"):
        nn.AdamW([np.zeros(3)])


@pytest.mark.parametrize(
    "params", [{"w": [0.0, 1.0]}, {"w": np.zeros(3, dtype=int)}, {0: np.zeros(3)}]
)
def test_adamw_params_must_be_floating_arrays(params):
    with pytest.raises(TypeError, match="params must map str names to floating NumPy arrays"):
        nn.AdamW(params)


def test_adamw_params_must_be_writable():
    (w,) = readonly(np.zeros(3))
    with pytest.raises(ValueError, match=r"params\['w'\] is read-only"):
        nn.AdamW({"w": w})


@pytest.mark.parametrize("option", ["lr", "eps", "weight_decay"])
def test_adamw_option_must_be_real(option):
    with pytest.raises(TypeError, match=f"{option} must be a real number; got '0.1'"):
        nn.AdamW({}, **{option: "0.1"})


@pytest.mark.parametrize(
    "option, value", [("lr", -1e-3), ("eps", math.nan), ("weight_decay", math.inf)]
)
def test_adamw_option_range(option, value):
    with pytest.raises(ValueError, match=rf"{option} must be a finite number in \[0.0, inf\]"):
        nn.AdamW({}, **{option: value})


def test_adamw_betas_must_be_a_pair():
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\); got 0.9"):
        nn.AdamW({}, betas=0.9)


def test_adamw_betas_range():
    with pytest.raises(
        ValueError, match=r"betas\[1\] must be a finite number in \[0.0, 1.0\); got 1.0"
    ):
        nn.AdamW({}, betas=(0.9, 1.0))


def test_adamw_grads_must_be_a_dict():
    with pytest.raises(TypeError, match="grads must be a dict keyed like params; got list"):
        nn.AdamW({"w": np.zeros(2)}).step([np.zeros(2)])


def test_adamw_grads_keys():
    with pytest.raises(ValueError, match=r"missing \['w'\], extra \['v'\]"):
        nn.AdamW({"w": np.zeros(2)}).step({"v": np.zeros(2)})


def test_adamw_grads_shape():
    with pytest.raises(
        ValueError,
        match=r"grads\['w'\] must have the shape of params\['w'\], "
        r"\(2,\); got \(3,\)",
    ):
        nn.AdamW({"w": np.zeros(2)}).step({"w": np.zeros(3)})
