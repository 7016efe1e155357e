"""The book's trained language model, shipped to the reader's browser: *The model, live*.

The page ``book/lm/live-model.md`` runs the model of *Training a language model*
(:func:`sdpa_book.pages.lm.trained_lm`) in the reader's browser, in plain JavaScript
(``book/_static/sdpa-live-lm.js``): the reader builds a sentence and sees every head's attention
and the next-word probabilities. This module writes what the script needs into the page:

* :func:`export_model`: the model's sizes and every parameter, as float32 bytes in base64
  (about 100 kB for the book's model of 19,200 parameters);
* :func:`grammar_automaton`: the training grammar as a finite automaton over words, with the
  grammar's own probability of each next word, so the page offers the words that may come next
  and shows what a perfect model would predict beside what this one predicts;
* :func:`live_model_widget`: the HTML of the widget, with a static summary for a reader without
  JavaScript.

The script reproduces :meth:`sdpa.nn.DecoderLM.forward` for the options the book's model uses
(layer norm with ``eps = 1e-5``, RoPE in the halves layout with base 10,000, causal attention
scaled by ``1 / sqrt(Dk)``, the MLP with GPT-2's ``tanh`` GELU, an untied unembedding), in
float64 from the float32 weights; the browser test compares it with the package.

>>> auto = grammar_automaton()
>>> sorted(auto.next_words("these small dogs near a cat".split()))[:4]
['follow', 'like', 'run', 'see']
>>> round(sum(auto.next_words(["these", "dogs"]).values()), 12)
1.0
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass

import numpy as np

import sdpa
from sdpa_book.pages.lm import ADJ, DET, NOUN, PREP, VERB, VERB_OBJ

__all__ = [
    "Automaton",
    "LiveModelWidget",
    "WORD_CLASSES",
    "export_model",
    "grammar_automaton",
    "live_model_widget",
    "next_word_probabilities",
]

#: The options of :class:`sdpa.nn.DecoderLM` the script implements, and the values it assumes.
SUPPORTED = dict(
    positional="rope",
    norm="layer",
    attention_only=False,
    qk_norm=False,
    logit_softcap=None,
    attn_softcap=None,
    sink=False,
    output_gate=False,
    differential=False,
)
LAYER_NORM_EPS = 1e-5  # sdpa.nn.layer_norm's default, which DecoderLM uses
ROPE_BASE = 10000.0  # sdpa.apply_rotary_embedding's default (halves layout)

#: The word classes of the grammar, in the order the page shows its word buttons.
WORD_CLASSES = {
    "determiner": DET["sg"] + DET["pl"],
    "adjective": ADJ,
    "noun": NOUN["sg"] + NOUN["pl"],
    "preposition": PREP,
    "verb": VERB["sg"] + VERB["pl"],
    "verb + object": VERB_OBJ["sg"] + VERB_OBJ["pl"],
    "end": ["."],
}


def export_model(model, vocab) -> dict:
    """The model's sizes, vocabulary and parameters as JSON-ready data for the page's script.

    Parameters
    ----------
    model : sdpa.nn.DecoderLM
        A float32 model with the options of the book's model (see ``SUPPORTED``).
    vocab : sequence of str
        The words, indexed by token id (``len(vocab) == model.vocab_size``).

    Returns
    -------
    dict
        ``config`` (sizes, ``eps``, ``rope_base``), ``vocab``, ``params`` (name to
        ``[offset, shape]``, offsets in floats) and ``weights``: every parameter, flattened in
        C order and concatenated, as little-endian float32 bytes in base64.

    Raises
    ------
    TypeError
        If ``model`` is not a float32 ``DecoderLM``.
    ValueError
        If ``model`` uses an option the script does not implement, or ``vocab`` does not
        have one word per token id.
    """
    if not isinstance(model, sdpa.nn.DecoderLM):
        raise TypeError(f"model must be an sdpa.nn.DecoderLM; got {type(model).__name__}")
    if model.dtype != np.float32:
        raise TypeError(f"model must be float32 (the page ships float32); got {model.dtype}")
    for name, value in SUPPORTED.items():
        if getattr(model, name) != value:
            raise ValueError(
                f"the page's script implements {name}={value!r} only; "
                f"got model.{name}={getattr(model, name)!r}"
            )
    if model.n_kv_heads != model.n_heads:
        raise ValueError(f"the script needs n_kv_heads == n_heads; got {model.n_kv_heads}")
    vocab = [str(w) for w in vocab]
    if len(vocab) != model.vocab_size:
        raise ValueError(
            f"vocab must have model.vocab_size={model.vocab_size} words; got {len(vocab)}"
        )
    params, chunks, offset = {}, [], 0
    for name, array in model.params.items():
        params[name] = [offset, list(array.shape)]
        chunks.append(np.ascontiguousarray(array, dtype="<f4").ravel())
        offset += array.size
    config = dict(
        d_model=model.d_model,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        head_dim=model.head_dim,
        d_ff=model.d_ff,
        vocab_size=model.vocab_size,
        max_len=model.max_len,
        eps=LAYER_NORM_EPS,
        rope_base=ROPE_BASE,
    )
    weights = base64.b64encode(np.concatenate(chunks).tobytes()).decode("ascii")
    return dict(config=config, vocab=vocab, params=params, weights=weights)


# -- the grammar as an automaton ---------------------------------------------------------------


@dataclass(frozen=True)
class Automaton:
    """The training grammar as a finite automaton over words, sentence after sentence.

    Attributes
    ----------
    states : list of dict
        ``states[s][word] = [next state, probability]``: the words the grammar allows in state
        ``s``, each with the grammar's probability of it given the words before.
    start : int
        The state at the start of a sentence (and after its ``"."``).
    """

    states: list
    start: int = 0

    def state(self, words) -> int | None:
        """The state after ``words`` (a sequence of str), or None if the grammar forbids them."""
        s = self.start
        for word in words:
            step = self.states[s].get(word)
            if step is None:
                return None
            s = step[0]
        return s

    def next_words(self, words) -> dict:
        """``{word: probability}`` of the words the grammar allows after ``words`` (empty if
        ``words`` already breaks the grammar)."""
        s = self.state(words)
        return {} if s is None else {w: p for w, (_, p) in self.states[s].items()}


def _phrase_rules(role: str, after) -> dict:
    """The states of a noun phrase: ``(role, "det"/"adj", number)`` -> {word: (state, p)}.

    ``after(number)`` is the state the phrase's noun leads to (the subject's number matters to
    the verb, the others' do not).
    """
    rules = {}
    for n in ("sg", "pl"):
        noun = {w: (after(n), 1.0 / len(NOUN[n])) for w in NOUN[n]}
        adj = {w: ((role, "adj", n), 0.4 / len(ADJ)) for w in ADJ}
        rules[(role, "det", n)] = adj | {w: (s, 0.6 * p) for w, (s, p) in noun.items()}
        rules[(role, "adj", n)] = noun
    return rules


def _dets(role: str, weight: float = 1.0) -> dict:
    """The four determiners opening a noun phrase of ``role``, each ``weight / 4``."""
    return {w: ((role, "det", n), weight / 4) for n in ("sg", "pl") for w in DET[n]}


def _verbs(n: str, weight: float) -> dict:
    """The verbs of number ``n``: half without an object (to the end), half with one."""
    out = {w: (("end",), weight / 2 / len(VERB[n])) for w in VERB[n]}
    return out | {w: (("obj",), weight / 2 / len(VERB_OBJ[n])) for w in VERB_OBJ[n]}


def grammar_automaton() -> Automaton:
    """The grammar of :mod:`sdpa_book.pages.lm` (and of the training page) as an automaton.

    Each state's words carry the grammar's probability of that word given the sentence so far:
    a determiner 1/4; an adjective 0.4 / 4 and a noun 0.6 / 6 after a determiner (1/6 after an
    adjective); after the subject, a preposition 0.5 / 3 and each verb of the subject's number
    0.25 / 3; after the prepositional phrase, each verb 0.5 / 3; ``"."`` after the verb or the
    object. The probabilities of a state's words sum to one.

    Returns
    -------
    Automaton
    """
    rules = {("start",): _dets("subj"), ("end",): {".": (("start",), 1.0)}}
    rules |= {("obj",): _dets("obj")}
    rules |= _phrase_rules("subj", lambda n: ("subj-noun", n))
    rules |= _phrase_rules("obj", lambda n: ("end",))
    for n in ("sg", "pl"):
        prep = {w: (("prep", n), 0.5 / len(PREP)) for w in PREP}
        rules[("subj-noun", n)] = prep | _verbs(n, 0.5)
        rules[("prep", n)] = {
            w: ((f"pp-{n}", "det", m), p) for w, ((_, _, m), p) in _dets("pp").items()
        }
        rules |= _phrase_rules(f"pp-{n}", lambda m, n=n: ("pp-noun", n))
        rules[("pp-noun", n)] = _verbs(n, 1.0)
    names = [("start",)] + sorted(set(rules) - {("start",)})
    number = {name: i for i, name in enumerate(names)}
    states = [
        {w: [number[target], float(p)] for w, (target, p) in rules[name].items()} for name in names
    ]
    return Automaton(states, number[("start",)])


# -- the widget --------------------------------------------------------------------------------


def next_word_probabilities(model, vocab, words) -> dict:
    """``{word: probability}`` of the model's next word after ``words``, most likely first.

    Parameters
    ----------
    model : sdpa.nn.DecoderLM
    vocab : sequence of str
        The words, by token id.
    words : sequence of str
        The sentence so far (at least one word, each in ``vocab``).
    """
    index = {w: i for i, w in enumerate(vocab)}
    missing = [w for w in words if w not in index]
    if missing or not len(words):
        raise ValueError(f"words must be one or more words of the vocabulary; got {list(words)!r}")
    logits = model.forward(np.array([index[w] for w in words]))[-1].astype(np.float64)
    p = sdpa.softmax(logits)
    order = np.argsort(-p, kind="stable")
    return {vocab[i]: float(p[i]) for i in order}


@dataclass
class LiveModelWidget:
    """The page's live model: its data, and its HTML for MyST-NB (``_repr_html_``).

    Attributes
    ----------
    data : dict
        What the script reads: :func:`export_model`'s fields, ``grammar`` (the automaton's
        states and start), ``classes`` (:data:`WORD_CLASSES`) and ``starters``.
    static_html : str
        What a reader without JavaScript sees instead.
    """

    data: dict
    static_html: str

    def data_json(self) -> str:
        """The data as JSON, safe inside a ``<script>`` element."""
        return json.dumps(self.data, separators=(",", ":")).replace("</", "<\\/")

    def _repr_html_(self) -> str:
        # The page's own files, relative to a page one folder below the site's root (lm/): the
        # same path works over http and from file://.
        return (
            '<link rel="stylesheet" href="../_static/sdpa-live-lm.css">'
            '<div class="sdpa-live-lm" data-sdpa-live-lm="1">'
            f'<div class="sdpa-live-static">{self.static_html}</div>'
            '<script type="application/json" class="sdpa-live-lm-data">'
            f"{self.data_json()}</script></div>"
            '<script defer src="../_static/sdpa-live-lm.js"></script>'
        )


def _static_html(model, vocab, starter: str, top: int = 5) -> str:
    """The widget's text without JavaScript: the model's top next words after ``starter``."""
    probs = list(next_word_probabilities(model, vocab, starter.split()).items())[:top]
    rows = "".join(f"<tr><td>{html.escape(w)}</td><td>{p:.3f}</td></tr>" for w, p in probs)
    return (
        "<p>With JavaScript on, this box runs the trained model in your browser: you build a "
        "sentence from the grammar's words and see the next-word probabilities and every "
        f"head's attention map change as you type. After <em>{html.escape(starter)}</em>, the "
        "model's most likely next words are:</p>"
        f"<table><thead><tr><th>next word</th><th>probability</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def live_model_widget(model, vocab, starters, heads=()) -> LiveModelWidget:
    """The live model of the page: the model's data, the grammar and a few starting sentences.

    Parameters
    ----------
    model : sdpa.nn.DecoderLM
        As :func:`export_model`.
    vocab : sequence of str
        The words, by token id.
    starters : sequence of str
        Sentences the reader can start from (words separated by spaces); the first is shown
        first, and summarised for a reader without JavaScript.
    heads : sequence of (int, int, str), optional
        Heads to name, ``(layer, head, name)``: the widget labels them, and shows the first
        enlarged at first (without: head 0.0).

    Raises
    ------
    ValueError
        If ``starters`` is empty, a starter breaks the grammar or is longer than the model
        reads, or a head is not in the model.
    """
    starters = [str(s) for s in starters]
    if not starters:
        raise ValueError("starters must hold at least one sentence; got none")
    auto = grammar_automaton()
    for s in starters:
        words = s.split()
        if auto.state(words) is None or not 0 < len(words) <= model.max_len:
            raise ValueError(
                f"each starter must be 1 to {model.max_len} words the grammar allows; got {s!r}"
            )
    named = []
    for layer, head, name in heads:
        if not (0 <= layer < model.n_layers and 0 <= head < model.n_heads):
            raise ValueError(
                f"heads must name heads of the model ({model.n_layers} layers of "
                f"{model.n_heads}); got layer {layer}, head {head}"
            )
        named.append(dict(layer=int(layer), head=int(head), name=str(name)))
    data = export_model(model, vocab)
    data |= dict(
        heads=named,
        grammar=dict(states=auto.states, start=auto.start),
        classes=WORD_CLASSES,
        starters=starters,
    )
    return LiveModelWidget(data, _static_html(model, vocab, starters[0]))
