"""What the tests of ``sdpa.nn``'s models share: the loss's derivative from the forward pass alone.

The tests import it as ``nn_checks`` (``tests/conftest.py`` puts this folder on the path).
"""

from __future__ import annotations

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
