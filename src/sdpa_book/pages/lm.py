"""The book's language model, trained once per build and shared by the pages that study it.

*Training a language model* (``book/lm/training.md``) builds a small grammar, a corpus drawn from
it and a two-block :class:`sdpa.nn.DecoderLM`, and trains it in front of the reader. Later pages
(quantised caches, latent attention, sinks, QK-norm) study that model or variants of it; training
it again on each page would cost the build its time budget. :func:`trained_lm` trains on first use
and keeps the result on disk, keyed by everything that could change it:

* the source of ``sdpa`` and of this module, NumPy's version and the arguments, so a changed
  package or recipe never reuses an old model;
* the folder is ``$SDPA_MODEL_CACHE`` (the book's build sets it to ``<doctrees>/models``); without
  it (a reader's notebook) the model is trained in memory and kept for the session.

The recipe is deterministic: one BLAS thread (as the training page runs it) and seeded generators,
so the model from the cache is bit for bit the model the training page trains: that page checks
the recipe against :func:`train_lm` and hands its model on with :func:`remember`.

>>> data = corpus_data()
>>> len(data.vocab), data.T
(36, 32)
>>> data.train_windows(np.array([0])).shape     # (B, T + 1) token ids from sentence starts
(1, 33)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import sdpa
from sdpa.nn import AdamW, DecoderLM, cross_entropy

try:
    import fcntl
except ImportError:  # not on Windows: there each page trains what it needs
    fcntl = None

__all__ = ["Corpus", "Trained", "corpus_data", "remember", "train_lm", "trained_lm"]

# -- the grammar (the same words and probabilities as the training page) -----------------------

DET = {"sg": ["a", "this"], "pl": ["some", "these"]}
ADJ = ["small", "old", "red", "happy"]
NOUN = {
    "sg": ["cat", "dog", "bird", "child", "farmer", "teacher"],
    "pl": ["cats", "dogs", "birds", "children", "farmers", "teachers"],
}
PREP = ["near", "behind", "with"]
VERB = {"sg": ["sleeps", "runs", "sings"], "pl": ["sleep", "run", "sing"]}
VERB_OBJ = {"sg": ["sees", "likes", "follows"], "pl": ["see", "like", "follow"]}
BOS = "<s>"


def _pick(rng, words):
    return words[rng.integers(len(words))]


def _noun_phrase(rng, role):
    n = "sg" if rng.random() < 0.5 else "pl"
    phrase = [(_pick(rng, DET[n]), role + "-det", 1 / 4)]
    if rng.random() < 0.4:
        phrase.append((_pick(rng, ADJ), role + "-adj", 0.4 / 4))
    p_noun = 1 / 6 if len(phrase) == 2 else 0.6 / 6
    phrase.append((_pick(rng, NOUN[n]), role + "-noun", p_noun))
    return n, phrase


def sentence(rng: np.random.Generator) -> list[tuple[str, str, float]]:
    """One sentence: ``[(word, role, probability of the word given the words before it)]``."""
    n, words = _noun_phrase(rng, "subj")
    has_pp = rng.random() < 0.5
    if has_pp:
        words += [(_pick(rng, PREP), "prep", 0.5 / 3)] + _noun_phrase(rng, "pp")[1]
    p_verb = 0.5 / 3 if has_pp else 0.5 * 0.5 / 3
    with_object = rng.random() < 0.5
    words.append((_pick(rng, (VERB_OBJ if with_object else VERB)[n]), "verb", p_verb))
    if with_object:
        words += _noun_phrase(rng, "obj")[1]
    return words + [(".", "end", 1.0)]


@dataclass(frozen=True)
class Corpus:
    """A training and a validation corpus drawn from the grammar, and how to cut windows.

    Attributes
    ----------
    vocab : list of str
        The words, sorted (with ``"<s>"`` last when ``bos``); a token id indexes it.
    T : int
        Window length the model reads; a window holds ``T + 1`` ids (inputs and targets).
    bos : bool
        Whether every window starts with the beginning-of-sequence token ``"<s>"`` (then
        ``T - 1`` words follow it).
    train_tokens, val_tokens : (N,) np.ndarray of int
        The token streams.
    train_roles, val_roles : (N,) np.ndarray of str
        Each token's role (``"subj-noun"``, ``"verb"``, ...).
    val_log_p : (N,) np.ndarray
        Log-probability of each validation token given the words before it in its sentence.
    train_starts, val_starts : np.ndarray of int
        Where the sentences start (those with a whole window after them).
    """

    vocab: list
    T: int
    bos: bool
    train_tokens: np.ndarray
    train_roles: np.ndarray
    train_starts: np.ndarray
    val_tokens: np.ndarray
    val_roles: np.ndarray
    val_log_p: np.ndarray
    val_starts: np.ndarray
    index: dict = field(repr=False, default_factory=dict)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
        words = self.T if self.bos else self.T + 1
        rows = np.stack([tokens[s : s + words] for s in np.asarray(starts)])
        if self.bos:
            rows = np.concatenate([np.full((len(rows), 1), self.index[BOS]), rows], axis=1)
        return rows

    def train_windows(self, rows: np.ndarray) -> np.ndarray:
        """``(len(rows), T + 1)`` training windows starting at sentences ``train_starts[rows]``."""
        return self._windows(self.train_tokens, self.train_starts[np.asarray(rows)])

    def val_windows(self, n: int = 128) -> tuple[np.ndarray, np.ndarray]:
        """``n`` validation windows (every fourth sentence start) and their start positions."""
        starts = self.val_starts[::4][:n]
        return self._windows(self.val_tokens, starts), starts

    def best_loss(self, n: int = 128) -> float:
        """The mean of ``-log p`` over the targets of the ``n`` validation windows: no model can
        do better on average (the first word after ``"<s>"`` counts like any other)."""
        _, starts = self.val_windows(n)
        k = 0 if self.bos else 1  # the first target is the word at s + k
        return float(-np.mean([self.val_log_p[s + k : s + k + self.T] for s in starts]))


@functools.cache
def corpus_data(T: int = 32, bos: bool = False) -> Corpus:
    """The training page's corpora: 8000 training sentences (seed 1), 800 validation (seed 2).

    Parameters
    ----------
    T : int, default 32
        Window length.
    bos : bool, default False
        Start every window with a beginning-of-sequence token ``"<s>"`` (a new vocabulary
        entry, so a different model).
    """
    groups = [*DET.values(), ADJ, *NOUN.values(), PREP, *VERB.values(), *VERB_OBJ.values()]
    vocab = sorted({w for group in groups for w in group} | {"."}) + ([BOS] if bos else [])
    index = {w: i for i, w in enumerate(vocab)}
    words_per_window = T if bos else T + 1

    def draw(seed, n_sentences):
        rng = np.random.default_rng(seed)
        words = [w for _ in range(n_sentences) for w in sentence(rng)]
        tokens = np.array([index[w] for w, _, _ in words])
        roles = np.array([role for _, role, _ in words])
        log_p = np.log([p for _, _, p in words])
        starts = np.flatnonzero(roles == "subj-det")
        return tokens, roles, log_p, starts[starts + words_per_window <= len(tokens)]

    train_tokens, train_roles, _, train_starts = draw(1, 8000)
    val_tokens, val_roles, val_log_p, val_starts = draw(2, 800)
    return Corpus(
        vocab,
        T,
        bos,
        train_tokens,
        train_roles,
        train_starts,
        val_tokens,
        val_roles,
        val_log_p,
        val_starts,
        index,
    )


# -- training ----------------------------------------------------------------------------------

#: The training page's model: two blocks of width 32, four heads, RoPE, layer norm, float32.
MODEL = dict(d_model=32, n_layers=2, n_heads=4, d_ff=64, positional="rope", norm="layer")


@dataclass
class Trained:
    """A trained model, its data and its learning curves.

    Attributes
    ----------
    model : sdpa.nn.DecoderLM
    data : Corpus
    train_loss : (steps,) np.ndarray
        The loss of each training batch.
    val_loss : (steps // eval_every,) np.ndarray
        The validation loss every ``eval_every`` steps.
    """

    model: DecoderLM
    data: Corpus
    train_loss: np.ndarray
    val_loss: np.ndarray


def _new_model(data: Corpus, seed: int, options: dict) -> DecoderLM:
    kwargs = MODEL | options
    return DecoderLM(
        vocab_size=len(data.vocab),
        max_len=data.T,
        dtype=np.float32,
        rng=np.random.default_rng(seed),
        **kwargs,
    )


def train_lm(
    *,
    steps: int = 200,
    lr: float = 3e-3,
    batch: int = 32,
    seed: int = 0,
    T: int = 32,
    bos: bool = False,
    eval_every: int = 20,
    on_step=None,
    **options,
) -> Trained:
    """Train the book's model (the training page's recipe), on one BLAS thread.

    Parameters
    ----------
    steps, lr, batch, seed : optional
        AdamW steps (weight decay 0.01), learning rate, windows per batch, and the seed of
        both the initial parameters and the batches.
    T, bos : optional
        The data, as :func:`corpus_data`.
    eval_every : int, default 20
        Steps between validation losses.
    on_step : callable, optional
        ``on_step(step, model, loss)`` after every step, to record what a page studies.
    **options
        Overrides of ``MODEL`` and further :class:`sdpa.nn.DecoderLM` arguments.
    """
    data = corpus_data(T, bos)
    val, _ = data.val_windows()
    with threadpool_limits(limits=1):
        model = _new_model(data, seed, options)
        opt = AdamW(model.params, lr=lr, weight_decay=0.01)
        rng = np.random.default_rng(seed)
        train_loss, val_loss = [], []
        for step in range(1, steps + 1):
            tokens = data.train_windows(rng.integers(len(data.train_starts), size=batch))
            loss, grads = model.loss_and_grads(tokens[:, :-1], tokens[:, 1:])
            opt.step(grads)
            train_loss.append(loss)
            if on_step is not None:
                on_step(step, model, loss)
            if step % eval_every == 0:
                val_loss.append(cross_entropy(model.forward(val[:, :-1]), val[:, 1:]))
    return Trained(model, data, np.array(train_loss), np.array(val_loss))


def _fingerprint(arguments: dict) -> str:
    digest = hashlib.sha256()
    package = Path(sdpa.__file__).parent
    for path in [*sorted(package.rglob("*.py")), Path(__file__)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"numpy {metadata.version('numpy')}".encode())
    digest.update(json.dumps(arguments, sort_keys=True).encode())
    return digest.hexdigest()[:20]


_IN_MEMORY: dict[str, Trained] = {}  # by the arguments' JSON: what this session trained or read


def _path(arguments: dict) -> Path | None:
    folder = os.environ.get("SDPA_MODEL_CACHE")
    return Path(folder) / f"lm-{_fingerprint(arguments)}.npz" if folder else None


def _save(result: Trained, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"param/" + k: v for k, v in result.model.params.items()}
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
        np.savez(f, train_loss=result.train_loss, val_loss=result.val_loss, **arrays)
    os.replace(f.name, path)  # atomic: a reader never sees half a file


@contextlib.contextmanager
def _locked(path: Path):
    """Hold ``<path>.lock`` exclusively: in a parallel build, two pages that need the same model
    at once train it once, the second waiting for the first's file (where ``fcntl`` exists)."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(arguments: dict, path: Path) -> Trained:
    with np.load(path) as saved:
        options = {k: v for k, v in arguments.items() if k not in TRAINING}
        data = corpus_data(arguments.get("T", 32), arguments.get("bos", False))
        model = _new_model(data, arguments.get("seed", 0), options)
        for name in model.params:
            model.params[name] = saved["param/" + name]
        return Trained(model, data, saved["train_loss"], saved["val_loss"])


def _trained(arguments: dict) -> Trained:
    path = _path(arguments)
    if path is None:
        return train_lm(**arguments)
    with _locked(path):
        if path.exists():
            return _load(arguments, path)
        result = train_lm(**arguments)
        _save(result, path)
        return result


TRAINING = {"steps", "lr", "batch", "seed", "T", "bos", "eval_every"}


def trained_lm(**arguments) -> Trained:
    """:func:`train_lm` with these arguments, trained once and then reused.

    Reused from ``$SDPA_MODEL_CACHE`` when set (the book's build), else from memory for the
    session. The result is shared: copy ``model.params`` before changing it.

    Parameters
    ----------
    **arguments
        As :func:`train_lm`, except ``on_step``; plain values (numbers, strings, booleans).
    """
    if "on_step" in arguments:
        raise TypeError("trained_lm caches its result, so it takes no on_step; use train_lm")
    key = json.dumps(arguments, sort_keys=True)
    if key not in _IN_MEMORY:
        _IN_MEMORY[key] = _trained(json.loads(key))
    return _IN_MEMORY[key]


def remember(trained: Trained) -> None:
    """Keep a model trained elsewhere as ``trained_lm()`` (the default arguments).

    The training page trains the model in front of the reader and checks that its recipe is
    :func:`train_lm`'s (the same losses, bit for bit, over the first steps); it then hands its
    model to the later pages with this, instead of their training it a second time.

    Parameters
    ----------
    trained : Trained
        The model, its corpus (that of :func:`corpus_data`) and its learning curves.
    """
    _IN_MEMORY[json.dumps({})] = trained
    path = _path({})
    if path is not None:
        _save(trained, path)
