r"""Helpers of the page *QK-norm and soft-capping*: the attention logits and entropies of a
:class:`sdpa.nn.DecoderLM`, and a probe that records them while the model trains.

A training run becomes unstable when attention logits grow: the softmax of a row whose largest
score stands far above the others is one-hot, its entropy falls to zero and little gradient
passes back through it. To watch this happen the page needs, at regular steps of training,

* the **logits**, the scaled scores :math:`z_{ij} = q_i \cdot k_j / \sqrt{D_k}` that enter the
  softmax (before a soft-cap, if the model has one): :func:`attention_logits`;
* the **entropy** :math:`-\sum_j a_{ij} \log a_{ij}` of each row of attention weights, 0 for a
  one-hot row and :math:`\log(i + 1)` for a uniform causal row: :func:`attention_entropy`;
* both recorded by :class:`AttentionProbe`, an ``on_step`` callback of
  :func:`sdpa_book.pages.lm.train_lm`;
* and one fix of the growth, applied between steps: :class:`QKClip`, Kimi K2's rescaling of
  the query and key projections of every head whose largest logit passed a threshold, on the
  batches of the recipe (:class:`RecipeBatches`).

Shape letters: ``B`` batch, ``Hq`` query heads, ``T`` sequence length (queries and keys),
``L`` the number of blocks.

>>> import numpy as np
>>> from sdpa.nn import DecoderLM
>>> model = DecoderLM(vocab_size=7, d_model=8, n_layers=2, n_heads=2, max_len=5,
...                   rng=np.random.default_rng(0))
>>> logits = attention_logits(model, np.array([[1, 2, 3, 4]]))
>>> len(logits), logits[0].shape                    # one (B, Hq, T, T) array per block
(2, (1, 2, 4, 4))
>>> bool(np.isneginf(logits[0][0, 0, 0, 1]))       # the future is masked
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .lm import corpus_data

__all__ = ["AttentionProbe", "QKClip", "RecipeBatches", "attention_entropy", "attention_logits"]


def attention_logits(model, tokens: np.ndarray) -> list[np.ndarray]:
    """Every block's attention logits on ``tokens``, as the model computes them.

    Parameters
    ----------
    model : sdpa.nn.DecoderLM
        Any model; its options (RoPE, QK-norm, grouped heads) are applied as in its forward.
    tokens : (B, T) np.ndarray of int
        Token ids.

    Returns
    -------
    logits : list of (B, Hq, T, T) np.ndarray
        One array per block: ``q_i . k_j / sqrt(Dk)`` for ``j <= i``, before any soft-cap,
        and ``-inf`` for the masked future ``j > i``.

    Notes
    -----
    The model's own forward pass computes them (``DecoderLM.forward(return_scores=True)``),
    so they are the logits the model uses, not a second implementation of it. The page checks
    that their softmax (after the model's soft-cap) is the model's attention weights.
    """
    _, logits = model.forward(np.asarray(tokens), return_scores=True)
    return logits


def attention_entropy(weights: np.ndarray) -> np.ndarray:
    """The entropy, in nats, of each row of attention weights (``0 log 0 = 0``).

    Parameters
    ----------
    weights : (..., S) array_like
        Rows of non-negative weights that sum to one.

    Returns
    -------
    entropy : (...) np.ndarray
        ``-sum_j a_j log a_j``: 0 for a one-hot row, ``log S`` for a uniform one.

    Examples
    --------
    >>> np.round(attention_entropy(np.array([[1.0, 0.0], [0.5, 0.5]])), 4) + 0.0
    array([0.    , 0.6931])
    """
    a = np.asarray(weights, dtype=np.float64)
    positive = a > 0
    return -np.sum(np.where(positive, a * np.log(np.where(positive, a, 1.0)), 0.0), axis=-1)


@dataclass
class AttentionProbe:
    """An ``on_step`` callback for :func:`sdpa_book.pages.lm.train_lm`: logits and entropies in training.

    At step 1 and every ``every`` steps it runs the model on ``tokens`` and records, per block,
    the largest logit magnitude and, per block and head, the mean entropy of the attention rows
    of queries 1 to ``T - 1`` (query 0 sees one key: its entropy is always 0).

    Parameters
    ----------
    tokens : (B, T) np.ndarray of int
        Fixed inputs (validation windows).
    every : int, default 10
        Steps between records.

    Attributes
    ----------
    steps : list of int
        The recorded steps.
    loss : list of float
        The training loss at each recorded step.
    max_logit : list of (L,) np.ndarray
        ``max |z_ij|`` over the batch, heads and allowed entries, per block.
    entropy : list of (L, Hq) np.ndarray
        The mean entropy of the weights the model uses (after any soft-cap), per block and head.

    Examples
    --------
    >>> from sdpa_book.pages.lm import corpus_data, train_lm
    >>> probe = AttentionProbe(corpus_data().val_windows(4)[0][:, :-1], every=2)
    >>> _ = train_lm(steps=4, on_step=probe)
    >>> probe.steps, probe.entropy[0].shape       # (L, Hq) for the book's model
    ([1, 2, 4], (2, 4))
    """

    tokens: np.ndarray
    every: int = 10
    steps: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    max_logit: list = field(default_factory=list)
    entropy: list = field(default_factory=list)

    def __call__(self, step: int, model, loss: float) -> None:
        if step != 1 and step % self.every:
            return
        logits = attention_logits(model, self.tokens)
        _, weights = model.forward(self.tokens, return_attention=True)
        self.steps.append(step)
        self.loss.append(float(loss))
        self.max_logit.append(np.array([np.abs(z[np.isfinite(z)]).max() for z in logits]))
        self.entropy.append(
            np.array([attention_entropy(w[:, :, 1:]).mean(axis=(0, 2)) for w in weights])
        )


class RecipeBatches:
    """The training windows :func:`sdpa_book.pages.lm.train_lm` draws at each step, drawn again.

    The recipe draws step ``n``'s batch as the ``n``-th call of
    ``rng.integers(len(data.train_starts), size=batch)`` on ``np.random.default_rng(seed)``;
    this object repeats those draws with its own generator, so that a callback can see the
    batch of the step it follows (``train_lm`` does not hand it over).

    Parameters
    ----------
    seed, batch, T, bos : optional
        As :func:`sdpa_book.pages.lm.train_lm` (its defaults).

    Examples
    --------
    >>> batches = RecipeBatches()
    >>> batches(1).shape                     # (batch, T): the inputs of step 1
    (32, 32)
    >>> bool(np.array_equal(batches(1), RecipeBatches()(1)))
    True
    """

    def __init__(self, seed: int = 0, batch: int = 32, T: int = 32, bos: bool = False):
        self._data = corpus_data(T, bos)
        self._rng = np.random.default_rng(seed)
        self._batch = batch
        self._drawn: list[np.ndarray] = []

    def __call__(self, step: int) -> np.ndarray:
        """The inputs ``(batch, T)`` of step ``step`` (1, 2, ...)."""
        if not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"step must be an integer >= 1; got {step!r}")
        while len(self._drawn) < step:
            rows = self._rng.integers(len(self._data.train_starts), size=self._batch)
            self._drawn.append(self._data.train_windows(rows)[:, :-1])
        return self._drawn[step - 1]


@dataclass
class QKClip:
    r"""QK-clip (Kimi K2's MuonClip), an ``on_step`` callback of :func:`~sdpa_book.pages.lm.train_lm`.

    After each optimiser step it computes, for every head ``h`` of every block, the largest
    logit ``S_h = max z_ij`` of the updated model on the step's batch; where ``S_h > tau`` it
    multiplies head ``h``'s columns of ``W_Q`` and of ``W_K`` by ``sqrt(tau / S_h)`` each, so
    that every logit of the head, bilinear in the two, shrinks by ``tau / S_h`` and the largest
    becomes ``tau``. The other heads are not touched.

    Parameters
    ----------
    tau : float
        The threshold, a positive number.
    batches : callable
        ``batches(step)``: the ``(B, T)`` inputs of the step (:class:`RecipeBatches`).

    Attributes
    ----------
    max_logit : list of (L, Hq) np.ndarray
        ``S_h`` at each step, before the clip.
    clipped : list of (L, Hq) np.ndarray of bool
        Which heads were rescaled at each step.

    Raises
    ------
    ValueError
        If ``tau`` is not positive and finite; when called, if the model has QK-norm (the norm
        would undo the rescaling).

    Notes
    -----
    Kimi K2 takes ``S_h`` from the step's own forward pass (the weights before the update),
    which costs nothing; this callback has no access to that pass and runs the updated model
    on the same batch instead, one more forward pass per step, after which no logit of the
    batch exceeds ``tau``. With grouped heads a key head serves several query heads, so only
    the query head is rescaled, by ``tau / S_h`` (as Kimi K2 leaves MLA's shared rotary key
    alone).

    Examples
    --------
    >>> from sdpa_book.pages.lm import train_lm
    >>> clip = QKClip(tau=5.0, batches=RecipeBatches())
    >>> run = train_lm(steps=3, lr=0.1, on_step=clip)
    >>> len(clip.max_logit), clip.clipped[0].shape          # steps, then (L, Hq)
    (3, (2, 4))
    """

    tau: float
    batches: object
    max_logit: list = field(default_factory=list)
    clipped: list = field(default_factory=list)

    def __post_init__(self):
        if not (isinstance(self.tau, (int, float)) and np.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"tau must be a positive, finite number; got {self.tau!r}")

    def __call__(self, step: int, model, loss: float) -> None:
        if model.qk_norm:
            raise ValueError("QKClip needs a model without qk_norm: the norm undoes the rescaling")
        Dk, grouped = model.head_dim, model.n_kv_heads != model.n_heads
        largest, clipped = [], []
        for i, z in enumerate(attention_logits(model, self.batches(step))):
            s_max = z.max(axis=(0, 2, 3))  # (Hq,): the masked -inf never wins
            over = s_max > self.tau
            gamma = np.where(over, self.tau / np.where(over, s_max, 1.0), 1.0)
            for h in np.flatnonzero(over):  # in place: the optimiser holds these arrays
                cols = slice(h * Dk, (h + 1) * Dk)
                w_q = model.params[f"blocks.{i}.attn.w_q"]
                if grouped:
                    w_q[:, cols] *= w_q.dtype.type(gamma[h])
                else:
                    w_q[:, cols] *= w_q.dtype.type(np.sqrt(gamma[h]))
                    model.params[f"blocks.{i}.attn.w_k"][:, cols] *= w_q.dtype.type(
                        np.sqrt(gamma[h])
                    )
            largest.append(s_max)
            clipped.append(over)
        self.max_logit.append(np.array(largest))
        self.clipped.append(np.array(clipped))
