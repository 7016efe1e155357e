"""The live model's data: the exported weights, the grammar's automaton and the widget's HTML."""

import base64
import json
import re

import numpy as np
import pytest

from sdpa.nn import DecoderLM
from sdpa_book.pages import live_model
from sdpa_book.pages.lm import ADJ, DET, NOUN, PREP, VERB, VERB_OBJ, corpus_data, sentence

VOCAB = corpus_data().vocab


def small_model(**options):
    kwargs = dict(
        vocab_size=len(VOCAB),
        d_model=8,
        n_layers=1,
        n_heads=2,
        d_ff=16,
        max_len=8,
        positional="rope",
        norm="layer",
        dtype=np.float32,
    )
    return DecoderLM(rng=np.random.default_rng(0), **(kwargs | options))


# -- the weights -------------------------------------------------------------------------------


def test_exported_weights_decode_to_the_parameters_bit_for_bit():
    model = small_model()
    data = live_model.export_model(model, VOCAB)
    flat = np.frombuffer(base64.b64decode(data["weights"]), dtype="<f4")
    assert flat.size == sum(p.size for p in model.params.values())
    assert set(data["params"]) == set(model.params)
    for name, (offset, shape) in data["params"].items():
        got = flat[offset : offset + int(np.prod(shape))].reshape(shape)
        np.testing.assert_array_equal(got, model.params[name])
    assert data["vocab"] == VOCAB
    c = data["config"]
    assert (c["d_model"], c["n_heads"], c["head_dim"], c["d_ff"], c["max_len"]) == (8, 2, 4, 16, 8)
    assert c["eps"] == 1e-5 and c["rope_base"] == 10000.0
    json.dumps(data)  # plain data


def test_export_refuses_what_the_script_does_not_implement():
    with pytest.raises(TypeError, match="DecoderLM"):
        live_model.export_model(object(), VOCAB)
    with pytest.raises(TypeError, match="float32"):
        live_model.export_model(small_model(dtype=np.float64), VOCAB)
    with pytest.raises(ValueError, match="qk_norm"):
        live_model.export_model(small_model(qk_norm=True), VOCAB)
    with pytest.raises(ValueError, match="positional"):
        live_model.export_model(small_model(positional="learned"), VOCAB)
    with pytest.raises(ValueError, match="differential"):
        live_model.export_model(small_model(differential=True), VOCAB)
    with pytest.raises(ValueError, match="n_kv_heads"):
        live_model.export_model(small_model(n_kv_heads=1), VOCAB)
    with pytest.raises(ValueError, match="36 words; got 35"):
        live_model.export_model(small_model(), VOCAB[:-1])


# -- the grammar -------------------------------------------------------------------------------


def test_every_sentence_of_the_grammar_is_accepted_with_its_probabilities():
    auto = live_model.grammar_automaton()
    rng = np.random.default_rng(7)
    stream = []
    for _ in range(300):
        words = sentence(rng)
        for k, (word, _, p) in enumerate(words):
            prefix = stream + [w for w, _, _ in words[:k]]
            assert auto.next_words(prefix)[word] == pytest.approx(p, rel=1e-12)
        stream += [w for w, _, _ in words]
    assert auto.state(stream) == auto.start


def test_each_states_probabilities_sum_to_one():
    auto = live_model.grammar_automaton()
    for state in auto.states:
        assert sum(p for _, p in state.values()) == pytest.approx(1.0, abs=1e-12)


# The training page's recogniser, written again here: word classes and a regular expression.
CLASS = {".": "."} | {w: "A" for w in ADJ} | {w: "P" for w in PREP}
for _n in ("sg", "pl"):
    for _table, _letter in ((DET, "D"), (NOUN, "N"), (VERB, "I"), (VERB_OBJ, "V")):
        CLASS |= {w: _letter + _n[0] for w in _table[_n]}
NP = "(Ds (A )?Ns |Dp (A )?Np )"
SENTENCE = re.compile(f"(Ds (A )?Ns (P {NP})?(Is |Vs {NP})|Dp (A )?Np (P {NP})?(Ip |Vp {NP}))\\. ")


def test_the_automaton_produces_only_sentences_of_the_grammar():
    """Random walks through the automaton, with uniform choices (not the grammar's), all match
    the training page's regular expression: the automaton allows nothing the grammar forbids."""
    auto = live_model.grammar_automaton()
    rng = np.random.default_rng(3)
    for _ in range(500):
        s, words = auto.start, []
        while True:
            word = sorted(auto.states[s])[rng.integers(len(auto.states[s]))]
            words.append(word)
            s = auto.states[s][word][0]
            if word == ".":
                break
        assert SENTENCE.fullmatch("".join(CLASS[w] + " " for w in words)), words


def test_broken_sentences_are_refused_and_the_next_words_are_the_grammars():
    auto = live_model.grammar_automaton()
    for text in [
        "some cats near a dog sleeps",  # the verb agrees with the distractor
        "a cats",
        "these dogs .",  # no verb
        "this dog sleeps a cat",  # an intransitive verb with an object
        "near a cat",
    ]:
        assert auto.state(text.split()) is None, text
        assert auto.next_words(text.split()) == {}
    assert auto.next_words([]) == {w: 0.25 for w in ["a", "this", "some", "these"]}
    after = auto.next_words("these small dogs near a cat".split())
    assert after == {w: pytest.approx(1 / 6) for w in VERB["pl"] + VERB_OBJ["pl"]}
    after_subject = auto.next_words("this dog".split())
    assert after_subject["near"] == pytest.approx(1 / 6)
    assert after_subject["sleeps"] == pytest.approx(1 / 12)
    assert "sleep" not in after_subject


# -- the widget --------------------------------------------------------------------------------


def test_next_word_probabilities_are_the_softmax_of_the_last_logits():
    model = small_model()
    words = ["these", "dogs", "near"]
    got = live_model.next_word_probabilities(model, VOCAB, words)
    logits = model.forward(np.array([VOCAB.index(w) for w in words]))[-1].astype(np.float64)
    want = np.exp(logits - logits.max())
    want /= want.sum()
    assert list(got.values()) == sorted(got.values(), reverse=True)
    for w, p in got.items():
        assert p == pytest.approx(want[VOCAB.index(w)], rel=1e-12)
    with pytest.raises(ValueError, match="words must be"):
        live_model.next_word_probabilities(model, VOCAB, ["unicorns"])
    with pytest.raises(ValueError, match="words must be"):
        live_model.next_word_probabilities(model, VOCAB, [])


def test_widget_html_holds_the_data_the_static_summary_and_the_script():
    model = small_model()
    w = live_model.live_model_widget(model, VOCAB, ["these dogs", "a cat"], heads=[(0, 1, "x")])
    page = w._repr_html_()
    payload = re.search(r'class="sdpa-live-lm-data">(.*?)</script>', page, re.S).group(1)
    data = json.loads(payload)
    assert data["starters"] == ["these dogs", "a cat"]
    assert data["heads"] == [dict(layer=0, head=1, name="x")]
    assert data["grammar"]["start"] == 0 and len(data["grammar"]["states"]) > 10
    assert 'src="../_static/sdpa-live-lm.js"' in page and "sdpa-live-lm.css" in page
    # without JavaScript: the top next words after the first starter, with probabilities
    top = next(iter(live_model.next_word_probabilities(model, VOCAB, ["these", "dogs"])))
    assert f"<td>{top}</td>" in page and "these dogs" in w.static_html
    # a word that closes the script element cannot end it early
    w.data["starters"] = ["</script><b>"]
    assert "</script><b>" not in w.data_json()


def test_widget_refuses_bad_starters_and_heads():
    model = small_model()
    with pytest.raises(ValueError, match="at least one"):
        live_model.live_model_widget(model, VOCAB, [])
    with pytest.raises(ValueError, match="grammar allows"):
        live_model.live_model_widget(model, VOCAB, ["dogs these"])
    with pytest.raises(ValueError, match="1 to 8 words"):
        live_model.live_model_widget(model, VOCAB, ["these dogs sleep . " * 3])
    with pytest.raises(ValueError, match="layer 1, head 0"):
        live_model.live_model_widget(model, VOCAB, ["a cat"], heads=[(1, 0, "no such")])
