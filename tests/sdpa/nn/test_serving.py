"""Tests of sdpa.nn.LLMEngine, the serving engine (issue 36, item 1; /work/shared/api-serving.md).

Every token is checked against ``DecoderLM.generate`` for the request alone (greedy, or sampled
with the same seed), over many configurations drawn by Hypothesis: block sizes, token budgets,
``max_num_seqs``, arrival patterns, pool sizes small enough to force preemptions. The packed
pass is checked against the model's own forward pass on the same prefixes (float64, rtol
1e-10); the statistics and the scheduler's precise readings against counts worked out by hand
in each test; speculative sampling on counts over many seeds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpa.nn import DecoderLM, EngineStats, LLMEngine
from sdpa.nn.packed import Segment, packed_forward

V = 13
OPTIONS = {
    "plain": {},
    "every option": dict(
        qk_norm=True, logit_softcap=5.0, attn_softcap=3.0, sink=True, output_gate=True, n_kv_heads=2
    ),
    "sinusoidal, rms": dict(positional="sinusoidal", norm="rms", n_kv_heads=1),
    "learned, attention only": dict(positional="learned", attention_only=True),
    "no positions": dict(positional=None),
}


def make_model(seed=0, max_len=48, **options):
    return DecoderLM(
        vocab_size=V, d_model=16, n_layers=2, n_heads=4, max_len=max_len,
        rng=np.random.default_rng(seed), **options,
    )  # fmt: skip


MODELS = {name: make_model(**options) for name, options in OPTIONS.items()}
MODEL = MODELS["every option"]


def greedy(model, prompt, n):
    return model.generate(np.array(prompt), n, temperature=0)[len(prompt) :].tolist()


# -- the packed pass -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIONS))
def test_packed_pass_equals_forward(name):
    """Two sequences packed in one pass, each in two chunks (the second over the first's keys
    and values): the logits are the model's forward pass's on the whole sequences."""
    model = MODELS[name]
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, V, 11), rng.integers(0, V, 6)
    L, H, D = model.n_layers, model.n_kv_heads, model.head_dim
    none = np.zeros((L, H, 0, D))
    tokens = np.concatenate([a[:7], b[:2]])
    positions = np.concatenate([np.arange(7), np.arange(2)])
    segs = [Segment(0, 7, none, none), Segment(7, 9, none, none)]
    first, K, Vs = packed_forward(model, tokens, positions, segs, np.arange(9))
    tokens = np.concatenate([b[2:], a[7:]])  # the other order: segments are independent
    positions = np.concatenate([np.arange(2, 6), np.arange(7, 11)])
    segs = [
        Segment(0, 4, K[:, :, 7:9], Vs[:, :, 7:9]),
        Segment(4, 8, K[:, :, :7], Vs[:, :, :7]),
    ]
    second, _, _ = packed_forward(model, tokens, positions, segs, np.arange(8))
    fa, fb = model.forward(a), model.forward(b)
    np.testing.assert_allclose(first[:7], fa[:7], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(first[7:], fb[:2], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(second[:4], fb[2:], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(second[4:], fa[7:], rtol=1e-10, atol=1e-12)


# -- exactness over configurations -------------------------------------------------------------


@st.composite
def workloads(draw):
    """Requests on a shared prefix (prompt, n, steps to run before adding it), engine options."""
    block_size = draw(st.integers(1, 5))
    shared = draw(st.lists(st.integers(0, V - 1), min_size=0, max_size=9))
    requests = []
    for _ in range(draw(st.integers(1, 5))):
        tail = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=6))
        prompt = (shared if draw(st.booleans()) else []) + tail
        requests.append((prompt, draw(st.integers(1, 8)), draw(st.integers(0, 2))))
    largest = max(math.ceil((len(p) + n) / block_size) for p, n, _ in requests)
    options = dict(
        num_blocks=largest + draw(st.sampled_from([0, 0, 1, 2, 6, 12])),  # small: preemptions
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 4)),
        max_batched_tokens=draw(st.integers(1, 14)),
        prefix_caching=draw(st.booleans()),
    )
    return requests, options


def serve(model, requests, options, **kwargs):
    engine = LLMEngine(model, **options)
    ids = []
    for prompt, n, wait in requests:
        for _ in range(wait):
            engine.step()
        ids.append(engine.add_request(prompt, n, **kwargs))
    return engine, ids, engine.run()


@pytest.mark.parametrize("name", ["plain", "every option"])
@settings(max_examples=50)
@given(work=workloads())
def test_greedy_tokens_equal_generate(name, work):
    model = MODELS[name]
    requests, options = work
    engine, ids, out = serve(model, requests, options)
    for i, (prompt, n, _) in zip(ids, requests):
        assert out[i] == greedy(model, prompt, n)
    stats, prompts = engine.stats, sum(len(p) for p, _, _ in requests)
    assert stats.generated_tokens == sum(n for _, n, _ in requests)
    assert stats.prefill_tokens + stats.cached_tokens >= prompts
    assert stats.cached_tokens % options["block_size"] == 0
    if stats.preemptions == 0:
        assert stats.prefill_tokens + stats.cached_tokens == prompts
        assert stats.decode_tokens == sum(n - 1 for _, n, _ in requests)
    assert stats.peak_blocks <= options["num_blocks"]


@settings(max_examples=30)
@given(work=workloads(), seed=st.integers(0, 2**32), top_k=st.sampled_from([None, 1, 3, V]))
def test_sampled_tokens_equal_generate(work, seed, top_k):
    requests, options = work
    _, ids, out = serve(MODEL, requests, options, temperature=0.9, top_k=top_k, seed=seed)
    for i, (prompt, n, _) in zip(ids, requests):
        rng = np.random.default_rng(seed)
        expected = MODEL.generate(np.array(prompt), n, temperature=0.9, top_k=top_k, rng=rng)
        assert out[i] == expected[len(prompt) :].tolist()


def test_a_small_pool_preempts_and_the_tokens_stay_exact():
    rng = np.random.default_rng(2)
    requests = [(rng.integers(0, V, 6).tolist(), 10, 0) for _ in range(4)]
    options = dict(num_blocks=6, block_size=3, max_num_seqs=4, max_batched_tokens=32)
    engine, ids, out = serve(MODEL, requests, options)
    assert engine.stats.preemptions > 0
    assert engine.stats.prefill_tokens > sum(len(p) for p, _, _ in requests)  # recomputed
    for i, (prompt, n, _) in zip(ids, requests):
        assert out[i] == greedy(MODEL, prompt, n)


# -- the scheduler's readings ------------------------------------------------------------------


def test_chunks_and_the_first_token():
    """Reading 5: a 12-token prompt under a budget of 5 runs as chunks 5, 5, 2; the third step
    emits the first token."""
    engine = LLMEngine(MODEL, num_blocks=8, block_size=4, max_batched_tokens=5)
    prompt = list(range(12))
    engine.add_request(prompt, 3)
    assert engine.step() == {} and engine.stats.prefill_tokens == 5
    assert engine.step() == {} and engine.stats.prefill_tokens == 10
    assert engine.step() == {0: greedy(MODEL, prompt, 1)}
    assert engine.stats.prefill_tokens == 12
    assert engine.run()[0] == greedy(MODEL, prompt, 3)
    assert engine.stats.steps == 5 and engine.stats.decode_tokens == 2


def test_requests_that_fit_take_max_new_tokens_steps():
    """Reading 6, and 4: every request fits: as many steps as the longest output; a step with
    nothing left does not count."""
    engine = LLMEngine(MODEL, num_blocks=16, block_size=4, max_batched_tokens=64)
    for prompt, n in (([1, 2, 3], 4), ([4, 5], 2), ([6, 7, 8, 9, 10], 6)):
        engine.add_request(prompt, n)
    engine.run()
    assert engine.step() == {}
    assert engine.stats.steps == 6
    assert engine.stats.decode_tokens == 3 + 1 + 5


def test_max_num_seqs_slot_is_not_reused_in_the_step_that_frees_it():
    engine = LLMEngine(MODEL, num_blocks=16, block_size=4, max_num_seqs=2)
    for n in (1, 3, 1):
        engine.add_request([1, 2, 3], n)
    assert set(engine.step()) == {0, 1}  # request 0 finishes here; 2 waits for the next step
    assert set(engine.step()) == {1, 2}


def test_prefix_cache_whole_blocks_and_the_last_block():
    """Reading 1: a prompt whose blocks are all cached computes its last block again."""
    engine = LLMEngine(MODEL, num_blocks=16, block_size=4)
    prompt = list(range(8))
    engine.add_request(prompt, 2)
    engine.run()
    assert engine.stats.cached_tokens == 0
    engine.add_request(prompt, 2)
    engine.add_request(prompt[:6] + [1, 1, 5], 2)  # one block in common
    out = engine.run()
    assert engine.stats.cached_tokens == 4 + 4
    assert engine.stats.prefill_tokens == 8 + 4 + 5
    assert out[1] == greedy(MODEL, prompt, 2)
    assert out[2] == greedy(MODEL, prompt[:6] + [1, 1, 5], 2)


def test_peak_blocks_alone_and_on_a_shared_prefix():
    """Reading 9: a lone request holds ceil((P + n - 1) / block_size) blocks at most; two
    requests on one cached prefix of 2 blocks hold it once: 2 + 1 + 1 blocks, not 6."""
    engine = LLMEngine(MODEL, num_blocks=16, block_size=4)
    shared = list(range(8))
    engine.add_request(shared + [9], 2)  # 10 tokens in the pool at most: 3 blocks
    engine.run()
    assert engine.stats.peak_blocks == 3
    engine.add_request(shared + [10], 2)
    engine.add_request(shared + [11], 2)
    engine.run()
    assert engine.stats.peak_blocks == 4
    assert engine.stats.cached_tokens == 16


def test_least_recently_used_cached_blocks_go_first():
    """Reading 12: with A's blocks released before B's, a request that needs a block evicts
    one of A's; B's prefix still hits, A's no longer does. Without the eviction both hit."""
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 0, 1]

    def cached_after(num_blocks):
        engine = LLMEngine(MODEL, num_blocks=num_blocks, block_size=2)
        hits = []
        for prompt in (a, b, c, b, a):  # C's 3 blocks leave none free: one cached goes
            before = engine.stats.cached_tokens
            engine.add_request(prompt, 1)
            engine.run()
            hits.append(engine.stats.cached_tokens - before)
        return hits, engine.stats.preemptions

    assert cached_after(6) == ([0, 0, 0, 2, 0], 0)
    assert cached_after(16) == ([0, 0, 0, 2, 2], 0)


def test_types_and_unknown_ids():
    engine = LLMEngine(MODEL, num_blocks=8, block_size=4)
    rid = engine.add_request(np.array([1, 2, 3]), 2)
    stepped = engine.step()
    assert all(type(t) is int for t in stepped[rid])
    assert engine.has_unfinished() is True and engine.finished(rid) is False
    out = engine.run()
    assert all(type(t) is int for t in out[rid] + engine.output(rid))
    assert engine.finished(rid) is True and engine.has_unfinished() is False
    assert all(type(v) is int for v in vars(engine.stats).values())
    assert isinstance(engine.stats, EngineStats)
    with pytest.raises(KeyError):
        engine.output(1)
    with pytest.raises(KeyError):
        engine.finished(-1)


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=4, block_size=0), "block_size"),
        (dict(num_blocks=4, max_num_seqs=0), "max_num_seqs"),
        (dict(num_blocks=4, max_batched_tokens=0), "max_batched_tokens"),
        (dict(num_blocks=4, prefix_caching=1), "prefix_caching"),
        (dict(num_blocks=4, draft_model="small"), "draft_model"),
        (dict(num_blocks=4, num_speculative_tokens=2), "num_speculative_tokens"),
        (dict(num_blocks=4, draft_model=MODEL, num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_blocks=4, draft_model=make_model(max_len=20), num_speculative_tokens=1),
         "draft_model"),
    ],
)  # fmt: skip
def test_construction_refusals(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name):
        LLMEngine(MODEL, **kwargs)


def test_a_draft_of_another_vocabulary_is_refused():
    other = DecoderLM(vocab_size=V + 1, d_model=8, n_layers=1, n_heads=2, max_len=48,
                      rng=np.random.default_rng(0))  # fmt: skip
    with pytest.raises(ValueError, match="draft_model"):
        LLMEngine(MODEL, num_blocks=4, draft_model=other, num_speculative_tokens=1)
    with pytest.raises(TypeError, match="model"):
        LLMEngine("model", num_blocks=4)


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        (([1] * 40, 9), {}, "max_len"),  # 49 > 48
        (([1] * 10, 7), {}, "num_blocks"),  # 17 tokens: 5 blocks of 4 > 4
        (([1, 2], 0), {}, "max_new_tokens"),
        (([1, V], 2), {}, "prompt"),
        (([], 2), {}, "prompt"),
        (([[1, 2]], 2), {}, "prompt"),
        (([1, 2], 2), dict(temperature=-1.0, seed=0), "temperature"),
        (([1, 2], 2), dict(temperature=float("nan"), seed=0), "temperature"),
        (([1, 2], 2), dict(temperature=1.0, top_k=0, seed=0), "top_k"),
        (([1, 2], 2), dict(temperature=1.0, top_k=V + 1, seed=0), "top_k"),
        (([1, 2], 2), dict(temperature=1.0), "seed"),
        (([1, 2], 2), dict(temperature=1.0, seed=1.5), "seed"),
    ],
)
def test_request_refusals_change_nothing(args, kwargs, name):
    engine = LLMEngine(MODEL, num_blocks=4, block_size=4)
    with pytest.raises((TypeError, ValueError), match=name):
        engine.add_request(*args, **kwargs)
    assert engine.has_unfinished() is False
    assert engine.add_request([1, 2], 2) == 0


# -- speculative decoding ------------------------------------------------------------------------

DRAFT = DecoderLM(vocab_size=V, d_model=8, n_layers=1, n_heads=2, max_len=64,
                  rng=np.random.default_rng(7))  # fmt: skip


def test_the_target_as_its_own_draft_accepts_everything():
    """Reading 8: n new tokens in at most 2 + ceil((n - 1) / k) steps."""
    n, k = 11, 3
    engine = LLMEngine(MODEL, num_blocks=16, block_size=4, draft_model=MODEL,
                       num_speculative_tokens=k)  # fmt: skip
    engine.add_request([3, 1, 4, 1, 5], n)
    assert engine.run()[0] == greedy(MODEL, [3, 1, 4, 1, 5], n)
    stats = engine.stats
    assert stats.steps <= 2 + math.ceil((n - 1) / k)
    assert stats.accepted_tokens == stats.proposed_tokens > 0


@settings(max_examples=25)
@given(work=workloads(), k=st.integers(1, 4))
def test_greedy_speculation_is_lossless(work, k):
    requests, options = work
    options = dict(options, draft_model=DRAFT, num_speculative_tokens=k)
    engine, ids, out = serve(MODEL, requests, options)
    for i, (prompt, n, _) in zip(ids, requests):
        assert out[i] == greedy(MODEL, prompt, n)
    assert engine.stats.accepted_tokens <= engine.stats.proposed_tokens


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _chi2(counts, probs):
    """Pearson's statistic and its cells: those expecting 5 or more counts, the rest as one."""
    expected = counts.sum() * probs
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    return float(((observed - expected) ** 2 / expected).sum()), len(observed)


def _critical(df, z=4.0):
    """The chi-square quantile at about 1 - 3e-5 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_speculative_sampling_keeps_the_targets_distribution():
    """The first two generated tokens over 1500 seeds: the first is drawn from the target
    directly, the second through a draft's proposal accepted or resampled. Their counts
    match the target's joint distribution p(t1) p(t2 | t1), and not the draft's."""
    target = make_model(seed=3, positional="rope")
    small = DecoderLM(vocab_size=V, d_model=8, n_layers=1, n_heads=2, max_len=48,
                      rng=np.random.default_rng(11))  # fmt: skip
    prompt, T = [2, 7, 1], 1.5
    engine = LLMEngine(target, num_blocks=512, block_size=4, max_num_seqs=256,
                       max_batched_tokens=1024, draft_model=small, num_speculative_tokens=2)  # fmt: skip
    seeds = range(1500)
    for seed in seeds:
        engine.add_request(prompt, 3, temperature=T, seed=seed)
    out = engine.run()
    counts = np.zeros((V, V))
    for seed in seeds:
        counts[out[seed][0], out[seed][1]] += 1
    p1 = _softmax(target.forward(np.array(prompt))[-1] / T)
    joint = np.stack([p1[t] * _softmax(target.forward(np.array(prompt + [t]))[-1] / T)
                      for t in range(V)])  # fmt: skip
    q_joint = np.stack([p1[t] * _softmax(small.forward(np.array(prompt + [t]))[-1] / T)
                        for t in range(V)])  # fmt: skip
    stat, cells = _chi2(counts.ravel(), joint.ravel())
    assert stat < _critical(cells - 1)
    assert _chi2(counts.ravel(), q_joint.ravel())[0] > _critical(cells - 1)  # the test can fail
    stats = engine.stats
    assert 0 < stats.accepted_tokens < stats.proposed_tokens


# -- the pool's addition -----------------------------------------------------------------------


def test_paged_cache_share_holds_full_blocks_and_refuses_others():
    """sdpa.PagedKVCache.share, the prefix cache's hold on a block: the shared blocks outlive
    their sequence and read back its keys; free, repeated or out-of-range blocks are refused."""
    from sdpa import PagedKVCache

    cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=1, dtype=np.float64)
    seq = cache.new_sequence()
    keys = np.arange(6.0).reshape(1, 6, 1)
    cache.append(seq, keys, -keys)
    kept = cache.share(cache.block_table(seq)[1:2])  # tokens 2 and 3
    cache.free(seq)
    assert cache.num_free_blocks == 3 and cache.length(kept) == 2
    k, v = cache.keys_values(kept)
    np.testing.assert_array_equal(k[0, :, 0], [2.0, 3.0])
    np.testing.assert_array_equal(v[0, :, 0], [-2.0, -3.0])
    block = cache.block_table(kept)[0]
    free = next(b for b in range(4) if b != block)
    for bad in ([free], [block, block], [4], [-1]):
        with pytest.raises(ValueError, match="blocks"):
            cache.share(bad)
    with pytest.raises(TypeError, match="blocks"):
        cache.share([1.5])
    assert cache.num_free_blocks == 3  # refusals took nothing
