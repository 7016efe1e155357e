"""The book's shared language model: the corpus, the recipe and the cache that reuses it."""

import threading
import time

import numpy as np
import pytest

from sdpa_book.pages import lm


def test_corpus_windows_are_sentences_shifted_by_one():
    data = lm.corpus_data()
    windows = data.train_windows(np.arange(5))
    assert windows.shape == (5, data.T + 1)
    first_words = {data.vocab[t] for t in windows[:, 0]}
    assert first_words <= {"a", "this", "some", "these"}  # every window starts a sentence
    assert np.array_equal(windows[0], data.train_tokens[data.train_starts[0] :][: data.T + 1])


def test_bos_windows_start_with_the_bos_token_and_keep_their_length():
    data = lm.corpus_data(T=16, bos=True)
    windows, _ = data.val_windows(8)
    assert windows.shape == (8, 17)
    assert np.all(windows[:, 0] == data.vocab.index("<s>"))
    assert data.vocab[windows[0, 1]] in {"a", "this", "some", "these"}


def test_best_loss_is_the_mean_negative_log_probability_of_the_targets():
    # Hand check on the first validation window: each word's probability from the grammar.
    data = lm.corpus_data(T=4)
    start = data.val_windows(1)[1][0]
    expected = -np.mean(data.val_log_p[start + 1 : start + 5])
    assert data.best_loss(1) == pytest.approx(expected)
    # A determiner has probability 1/4 given the words before it.
    det = np.flatnonzero(data.val_roles == "subj-det")[0]
    assert data.val_log_p[det] == pytest.approx(np.log(1 / 4))


def test_trained_lm_reuses_the_saved_model_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("SDPA_MODEL_CACHE", str(tmp_path))
    lm._IN_MEMORY.clear()
    first = lm.trained_lm(steps=3, T=8)
    saved = list(tmp_path.glob("lm-*.npz"))
    assert len(saved) == 1
    lm._IN_MEMORY.clear()
    again = lm.trained_lm(steps=3, T=8)  # now read from the file
    assert again is not first
    for name, value in first.model.params.items():
        assert np.array_equal(again.model.params[name], value)
    assert np.array_equal(again.train_loss, first.train_loss)
    fresh = lm.train_lm(steps=3, T=8)  # and the file holds what training gives
    assert np.array_equal(fresh.model.params["unembedding"], again.model.params["unembedding"])
    lm.trained_lm(steps=4, T=8)  # other arguments, another file
    assert len(list(tmp_path.glob("lm-*.npz"))) == 2
    lm._IN_MEMORY.clear()


@pytest.mark.skipif(lm.fcntl is None, reason="no fcntl: pages train apart (Windows)")
def test_pages_that_need_the_same_model_at_once_train_it_once(tmp_path, monkeypatch):
    # Two kernels of a parallel build ask for the same model: one trains, the other waits for
    # its file and reads it.
    monkeypatch.setenv("SDPA_MODEL_CACHE", str(tmp_path))
    calls = []
    train = lm.train_lm

    def counted(**arguments):
        calls.append(arguments)
        time.sleep(0.3)  # long enough for the other thread to arrive meanwhile
        return train(**arguments)

    monkeypatch.setattr(lm, "train_lm", counted)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(lm._trained(dict(steps=3, T=8))))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(results) == 2
    for name, value in results[0].model.params.items():
        assert np.array_equal(results[1].model.params[name], value)


def test_training_lowers_the_loss():
    result = lm.train_lm(steps=40, T=8, eval_every=20)
    assert result.val_loss.shape == (2,)
    assert result.train_loss[-5:].mean() < result.train_loss[:5].mean() - 0.5


def test_trained_lm_refuses_a_callback():
    with pytest.raises(TypeError, match="on_step"):
        lm.trained_lm(on_step=print)


def test_remember_hands_a_model_to_trained_lm(tmp_path, monkeypatch):
    monkeypatch.setenv("SDPA_MODEL_CACHE", str(tmp_path))
    lm._IN_MEMORY.clear()
    mine = lm.train_lm(steps=2)
    data = lm.corpus_data()
    lm.remember(lm.Trained(mine.model, data, mine.train_loss, mine.val_loss))
    assert lm.trained_lm() is not None and lm.trained_lm().model is mine.model
    lm._IN_MEMORY.clear()  # a later session reads the file
    again = lm.trained_lm()
    assert np.array_equal(again.model.params["unembedding"], mine.model.params["unembedding"])
    lm._IN_MEMORY.clear()
