"""What the tests of ``sdpa.nn`` share: the loss's derivative from the forward pass alone (the
models' tests); the sizes, tolerances, entry-by-entry central differences and read-only copies of
the tests of its functions (test_functional, test_losses, test_softcap, test_optim).

The tests import it as ``nn_checks`` (``tests/conftest.py`` puts this folder on the path).
"""

from __future__ import annotations

import numpy as np
import pytest

from sdpa import nn


def central_difference(model, tokens, targets, name, direction, eps=1e-6):
    """d loss / d t of loss(params[name] + t * direction) at t = 0, by a central difference;
    the loss from forward() alone, independent of the backward pass."""
    p = model.params[name]
    saved = p.copy()
    losses = []
    for sign in (1.0, -1.0):
        p[...] = saved + sign * eps * direction
        losses.append(nn.cross_entropy(model.forward(tokens), targets))
    p[...] = saved
    return (losses[0] - losses[1]) / (2 * eps)


def assert_grads_match_differences(model, tokens, targets, entries) -> None:
    """``model.loss_and_grads`` against the forward pass: the loss equal to the cross-entropy of
    ``forward``, and each parameter's gradient against central differences, entry by entry
    (``entries(name) = (all_up_to, sampled)``: every entry of a parameter of at most
    ``all_up_to`` entries, else ``sampled`` random ones) and along one random direction."""
    loss, grads = model.loss_and_grads(tokens, targets)
    assert loss == pytest.approx(nn.cross_entropy(model.forward(tokens), targets), rel=1e-14)
    assert list(grads) == list(model.params)
    pick = np.random.default_rng(1)
    for name, g in grads.items():
        p = model.params[name]
        assert g.shape == p.shape and g.dtype == np.float64, name
        all_up_to, sampled = entries(name)
        chosen = range(p.size) if p.size <= all_up_to else pick.choice(p.size, sampled, False)
        for flat in chosen:
            e = np.zeros(p.size)
            e[flat] = 1.0
            numeric = central_difference(model, tokens, targets, name, e.reshape(p.shape))
            assert g.flat[flat] == pytest.approx(numeric, rel=1e-6, abs=1e-8), (name, flat)
        u = pick.standard_normal(p.shape)
        numeric = central_difference(model, tokens, targets, name, u)
        assert np.sum(g * u) == pytest.approx(numeric, rel=1e-6, abs=1e-8), name


# Every dimension a different size, so that a swapped axis cannot pass: leading (2, 3), features
# E = 5, outputs OUT = 7, vocabulary V = 11 (the tests of sdpa.nn's functions).
LEAD, E, OUT, V = (2, 3), 5, 7, 11

F64 = dict(rtol=1e-10, atol=1e-10)  # against torch, float64

F32 = dict(rtol=1e-5, atol=1e-5)  # against torch, float32

FD = dict(rtol=1e-6, atol=1e-8)  # against central differences (step 1e-6), float64


def central_differences(f, args, d_y, i, eps=1e-6):
    """d/d args[i] of sum(d_y * f(*args)), one entry at a time, in float64."""
    args = [np.array(a, dtype=np.float64) for a in args]
    grad = np.zeros_like(args[i])
    for idx in np.ndindex(*args[i].shape):
        saved = args[i][idx]
        args[i][idx] = saved + eps
        up = np.sum(d_y * f(*args))
        args[i][idx] = saved - eps
        down = np.sum(d_y * f(*args))
        args[i][idx] = saved
        grad[idx] = (up - down) / (2 * eps)
    return grad


def readonly(*arrays):
    """Copies that raise if anything writes to them: the functions must not mutate inputs."""
    out = []
    for a in arrays:
        a = np.array(a)
        a.flags.writeable = False
        out.append(a)
    return out


# The tiny language models of test_model, test_generation and test_inputs: V = 7, E = 8, two
# blocks, at most 6 tokens; each configuration of LM_CONFIGS a variant of it.
LM_SIZES = dict(vocab_size=7, d_model=8, n_layers=2, n_heads=2, d_ff=12, max_len=6)
LM_CONFIGS = {
    "rope-layer": dict(positional="rope", norm="layer"),
    "sinusoidal-rms": dict(positional="sinusoidal", norm="rms"),
    "learned-layer": dict(positional="learned", norm="layer"),
    "none-rms": dict(positional=None, norm="rms"),
    "gqa-rope": dict(positional="rope", n_heads=4, n_kv_heads=2),
    "mqa-learned-rms": dict(positional="learned", norm="rms", n_heads=2, n_kv_heads=1),
    "attention-only-rope": dict(positional="rope", attention_only=True),
    "attention-only-gqa-sinusoidal": dict(
        positional="sinusoidal", attention_only=True, n_heads=4, n_kv_heads=2
    ),
}


def make_model(seed=0, **overrides):
    config = dict(LM_SIZES, rng=np.random.default_rng(seed))
    config.update(overrides)
    model = nn.DecoderLM(**config)
    # Random norm gains and biases, so that their gradients are not tested at a special point.
    rng = np.random.default_rng(seed + 1)
    for name, p in model.params.items():
        if "norm" in name:
            p += 0.3 * rng.standard_normal(p.shape).astype(p.dtype)
    return model
