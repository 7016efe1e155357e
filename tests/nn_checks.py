"""What the tests of ``sdpa.nn`` share: the loss's derivative from the forward pass alone (the
models' tests); the sizes, tolerances, entry-by-entry central differences and read-only copies of
the tests of its functions (test_functional, test_losses, test_softcap, test_optim).

The tests import it as ``nn_checks`` (``tests/conftest.py`` puts this folder on the path).
"""

from __future__ import annotations

import numpy as np

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
