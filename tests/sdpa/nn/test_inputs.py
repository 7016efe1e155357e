"""sdpa.nn.inputs through sdpa.nn.DecoderLM: every ``raise`` of the checks of token ids and
targets, each with the argument's name, what was expected and what was given. (The checks of
kv_transform and attn_mask are tested with those features in test_model.py.)

The module has no public names: the model's forward and loss_and_grads are its interface.
"""

from __future__ import annotations

import numpy as np
import pytest
from nn_checks import LM_SIZES, make_model

V = LM_SIZES["vocab_size"]


def test_tokens_must_be_integers():
    with pytest.raises(
        TypeError, match="tokens must be an integer array of token ids; got dtype float64"
    ):
        make_model().forward(np.array([1.0, 2.0]))


@pytest.mark.parametrize("tokens", [np.zeros((1, 1, 2), dtype=int), np.zeros((2, 0), dtype=int)])
def test_tokens_must_be_1d_or_2d_and_not_empty(tokens):
    with pytest.raises(ValueError, match=r"tokens must have shape \(T,\) or \(B, T\) with T >= 1"):
        make_model().forward(tokens)


def test_tokens_must_fit_max_len():
    with pytest.raises(ValueError, match="tokens holds T=7 tokens, more than max_len=6"):
        make_model().forward(np.zeros(7, dtype=int))


@pytest.mark.parametrize("bad", [-1, V])
def test_token_ids_must_be_in_the_vocabulary(bad):
    with pytest.raises(
        ValueError, match=rf"tokens must hold token ids in \[0, vocab_size=7\); got {bad}"
    ):
        make_model().forward(np.array([0, bad]))


def test_targets_must_be_integers():
    with pytest.raises(
        TypeError, match="targets must be an integer array of token ids; got dtype float64"
    ):
        make_model().loss_and_grads(np.array([1, 2]), np.array([1.0, 2.0]))


def test_targets_must_have_the_shape_of_tokens():
    with pytest.raises(
        ValueError, match=r"targets must have the shape of tokens, \(1, 2\); got \(1, 3\)"
    ):
        make_model().loss_and_grads(np.array([1, 2]), np.array([1, 2, 3]))


def test_targets_must_be_in_the_vocabulary():
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 7\); got the value 7"):
        make_model().loss_and_grads(np.array([1, 2]), np.array([1, 7]))
