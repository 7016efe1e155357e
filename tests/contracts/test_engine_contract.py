"""Acceptance tests of the serving engine ``sdpa.nn.LLMEngine``, written from its contract alone
(``../shared/api-serving.md``, issue 36): construction, requests, exactness, memory, statistics,
the 14 precise readings and every refusal.

The suite is black-box: it uses only the public API (``sdpa.nn.LLMEngine``, ``sdpa.nn.DecoderLM``
and its ``generate`` and ``forward``), never the engine's code. Expected tokens come from
``DecoderLM.generate``, the contract's reference for exactness (greedy, or sampled with
``rng=np.random.default_rng(seed)``), with the contract's rounding proviso checked where a token
differs (the two largest logits within 1e-4, or a draw within 1e-9 of its interval's edge, both
recomputed here with ``forward``). Expected statistics are counted by hand from the readings:
chunk sizes, steps, cached tokens in whole blocks, blocks held, the least recently used block to
go. Speculative sampling is checked on counts: a chi-square test over the joint law of three
tokens on a three-token vocabulary, with its threshold set for a false alarm below 1e-6.

Every engine is driven with :func:`drain`, a bounded loop of ``step()``: an engine that stops
making progress fails a test instead of hanging it.
"""

from __future__ import annotations

import inspect
import itertools
import math
from numbers import Integral

import numpy as np
import pytest

import sdpa.nn
from sdpa.nn import DecoderLM

LLMEngine = sdpa.nn.LLMEngine

STATS = (
    "steps",
    "prefill_tokens",
    "cached_tokens",
    "decode_tokens",
    "generated_tokens",
    "preemptions",
    "proposed_tokens",
    "accepted_tokens",
    "peak_blocks",
)
V = 13  # the test model's vocabulary: every size below differs from it
MAX_LEN = 40


def make_model(seed=1, **options):
    kw = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, max_len=MAX_LEN) | options
    return DecoderLM(**kw, rng=np.random.default_rng(seed))


MODEL = make_model()


def engine_of(model=MODEL, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLMEngine(model, **kw)


def random_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).tolist() for n in lengths]


def stats_of(engine) -> dict:
    return {name: getattr(engine.stats, name) for name in STATS}


def drain(engine, limit=400) -> tuple[dict, list]:
    """Step until nothing is unfinished (at most ``limit`` steps): the tokens by id, and each
    step's answer; every answer checked for its types (reading 14)."""
    tokens, answers = {}, []
    for _ in range(limit):
        if not engine.has_unfinished():
            return tokens, answers
        answer = engine.step()
        check_step_answer(answer)
        answers.append(answer)
        for rid, new in answer.items():
            tokens.setdefault(rid, []).extend(new)
    pytest.fail(f"the engine still had unfinished requests after {limit} steps")


def is_count(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= 0


def check_step_answer(answer):
    assert type(answer) is dict
    for rid, new in answer.items():
        assert type(rid) is int
        assert type(new) is list and new, "a request that emitted nothing is absent"
        assert all(type(t) is int for t in new)


def uniforms(seed, count):
    """The first ``count`` draws of ``default_rng(seed)``, one per token as ``generate`` takes."""
    rng = np.random.default_rng(seed)
    return [float(rng.random((1, 1))[0, 0]) for _ in range(count)]


def sampling_law(logits, temperature, top_k):
    """The law ``generate`` samples from, written anew: top_k by a stable sort, softmax of the
    logits minus their largest divided by the temperature."""
    z = np.asarray(logits, dtype=np.float64)
    if top_k is not None:
        kept = np.zeros(z.shape, dtype=bool)
        kept[np.argsort(-z, kind="stable")[:top_k]] = True
        z = np.where(kept, z, -np.inf)
    e = np.exp((z - z.max()) / temperature)
    return e / e.sum()


def justify(model, prefix, token, temperature, top_k, draw):
    """Assert that taking ``token`` after ``prefix`` is within the contract's rounding proviso."""
    logits = model.forward(np.array(prefix))[-1]
    if temperature == 0:
        gap = float(logits.max() - logits[token])
        assert gap <= 1e-4, f"token {token} is {gap:.3g} below the largest logit after {prefix}"
        return
    cdf = np.cumsum(sampling_law(logits, temperature, top_k))
    x = draw * cdf[-1]
    low, high = (cdf[token - 1] if token else 0.0), cdf[token]
    distance = max(low - x, x - high, 0.0)
    assert high > low and distance <= 1e-9, f"token {token} lies {distance:.3g} from the draw"


def check_tokens(model, prompt, got, n, *, temperature=0.0, top_k=None, seed=None):
    """Assert ``got`` is ``generate``'s continuation of ``prompt`` (the contract's exactness),
    a differing token allowed only within the rounding proviso, the rest then followed anew."""
    assert type(got) is list and all(type(t) is int for t in got)
    assert len(got) == n, f"{len(got)} tokens where max_new_tokens={n}"
    draws = uniforms(seed, n) if temperature > 0 else [None] * n
    done = 0
    while done < n:
        prefix = list(prompt) + got[:done]
        rng = None
        if temperature > 0:
            rng = np.random.default_rng(seed)
            for _ in range(done):  # the draws of the tokens already taken
                rng.random((1, 1))
        want = model.generate(
            np.array(prefix), n - done, temperature=temperature, top_k=top_k, rng=rng
        )[len(prefix) :].tolist()
        if got[done:] == want:
            return
        j = done + next(i for i, (a, b) in enumerate(zip(got[done:], want)) if a != b)
        justify(model, list(prompt) + got[:j], got[j], temperature, top_k, draws[j])
        done = j + 1


def chi2_tail(x, df):
    """P(chi-square with an even ``df`` > x), in closed form: exp(-x/2) sum_i<df/2 (x/2)^i / i!."""
    assert df % 2 == 0
    half = x / 2
    return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(df // 2))


def chi2_threshold(df, alpha):
    low, high = 0.0, 10.0 * df + 100.0
    for _ in range(200):  # bisection: the tail decreases in x
        mid = (low + high) / 2
        low, high = (mid, high) if chi2_tail(mid, df) > alpha else (low, mid)
    return high


# ---- the suite's own yardsticks -----------------------------------------------------------------


def test_check_tokens_accepts_generate_and_refuses_a_changed_token():
    prompt = random_prompts([5])[0]
    greedy = MODEL.generate(np.array(prompt), 6, temperature=0)[5:].tolist()
    check_tokens(MODEL, prompt, greedy, 6)
    logits = MODEL.forward(np.array(prompt + greedy[:2]))[-1]
    worst = int(np.argmin(logits))  # far below the largest logit: never within the proviso
    with pytest.raises(AssertionError):
        check_tokens(MODEL, prompt, greedy[:2] + [worst] + greedy[3:], 6)
    with pytest.raises(AssertionError):
        check_tokens(MODEL, prompt, greedy[:5], 6)
    sampled = MODEL.generate(np.array(prompt), 6, temperature=1.3, rng=np.random.default_rng(4))
    sampled = sampled[5:].tolist()
    check_tokens(MODEL, prompt, sampled, 6, temperature=1.3, seed=4)
    with pytest.raises(AssertionError):
        check_tokens(MODEL, prompt, sampled, 6, temperature=1.3, seed=5)


def test_chi2_tail_and_threshold():
    for x in (0.5, 3.0, 11.0):
        assert chi2_tail(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-14)
        assert chi2_tail(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-14)
    threshold = chi2_threshold(26, 1e-6)
    assert chi2_tail(threshold, 26) == pytest.approx(1e-6, rel=1e-6)
    # Wilson-Hilferty's approximation, with 4.7534 the normal quantile of 1 - 1e-6: 76.2.
    cube = 1 - 2 / (9 * 26) + 4.753424 * math.sqrt(2 / (9 * 26))
    assert threshold == pytest.approx(26 * cube**3, rel=0.02)


# ---- construction -------------------------------------------------------------------------------


def test_engine_is_public():
    assert "LLMEngine" in sdpa.nn.__all__


def test_signatures_as_the_contract_writes_them():
    params = inspect.signature(LLMEngine).parameters
    defaults = dict(
        num_blocks=inspect.Parameter.empty,
        block_size=16,
        max_num_seqs=8,
        max_batched_tokens=64,
        prefix_caching=True,
        draft_model=None,
        num_speculative_tokens=0,
    )
    assert list(params) == ["model", *defaults]
    for name, default in defaults.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == default or params[name].default is default
    add = inspect.signature(LLMEngine.add_request).parameters
    assert list(add)[1:3] == ["prompt", "max_new_tokens"]
    for name, default in dict(temperature=0.0, top_k=None, seed=None).items():
        assert add[name].kind is inspect.Parameter.KEYWORD_ONLY and add[name].default == default


def test_block_size_defaults_to_16():
    engine = LLMEngine(MODEL, num_blocks=4)
    engine.add_request(random_prompts([20])[0], 20)  # 40 tokens: 3 blocks of 16
    with pytest.raises(ValueError):
        LLMEngine(MODEL, num_blocks=2).add_request(random_prompts([20])[0], 20)


SMALL_VOCAB = dict(vocab_size=V + 1)
SHORT = dict(max_len=MAX_LEN - 1)
REFUSED_ENGINES = {
    "num_blocks=0": (dict(num_blocks=0), "num_blocks"),
    "num_blocks=-3": (dict(num_blocks=-3), "num_blocks"),
    "num_blocks=2.5": (dict(num_blocks=2.5), "num_blocks"),
    "block_size=0": (dict(block_size=0), "block_size"),
    "block_size=1.0": (dict(block_size=1.0), "block_size"),
    "max_num_seqs=0": (dict(max_num_seqs=0), "max_num_seqs"),
    "max_batched_tokens=0": (dict(max_batched_tokens=0), "max_batched_tokens"),
    "prefix_caching=1": (dict(prefix_caching=1), "prefix_caching"),
    "prefix_caching='yes'": (dict(prefix_caching="yes"), "prefix_caching"),
    "k without draft": (dict(num_speculative_tokens=2), "num_speculative_tokens"),
    "draft not a model": (dict(draft_model="tiny", num_speculative_tokens=2), "draft_model"),
    "draft of another vocab": (
        dict(draft_model=make_model(2, **SMALL_VOCAB), num_speculative_tokens=2),
        "draft_model",
    ),
    "draft with a shorter max_len": (
        dict(draft_model=make_model(2, **SHORT), num_speculative_tokens=2),
        "draft_model",
    ),
    "draft with k=0": (
        dict(draft_model=make_model(2), num_speculative_tokens=0),
        "num_speculative_tokens",
    ),
    "draft with k=-1": (
        dict(draft_model=make_model(2), num_speculative_tokens=-1),
        "num_speculative_tokens",
    ),
}


@pytest.mark.parametrize("kwargs, name", REFUSED_ENGINES.values(), ids=REFUSED_ENGINES)
def test_construction_refusals_name_the_argument(kwargs, name):
    kwargs = dict(num_blocks=8, block_size=4) | kwargs
    with pytest.raises((ValueError, TypeError), match=name):
        LLMEngine(MODEL, **kwargs)


def test_model_must_be_a_decoder_lm():
    with pytest.raises((ValueError, TypeError), match="model"):
        LLMEngine(MODEL.params, num_blocks=8)


def test_a_longer_draft_of_the_same_vocab_is_accepted():
    draft = make_model(3, d_model=8, n_layers=1, max_len=MAX_LEN + 8)
    engine = engine_of(draft_model=draft, num_speculative_tokens=2)
    prompt = random_prompts([6])[0]
    engine.add_request(prompt, 5)
    check_tokens(MODEL, prompt, drain(engine)[0][0], 5)


# ---- requests: ids, refusals, types ---------------------------------------------------------------


def test_request_ids_count_from_zero_in_order():
    engine = engine_of()
    ids = [engine.add_request(p, 2) for p in random_prompts([3, 1, 4])]
    assert ids == [0, 1, 2] and all(type(i) is int for i in ids)


# (args, kwargs, the exception, a pattern of the argument named); None: ValueError or TypeError,
# where the contract names no type.
REFUSED_REQUESTS = {
    "empty prompt": (([], 2), {}, None, "prompt"),
    "token = vocab_size": (([1, V], 2), {}, None, "prompt"),
    "negative token": (([1, -1], 2), {}, None, "prompt"),
    "2-D prompt": (([[1, 2]], 2), {}, None, "prompt"),
    "beyond max_len": (([1] * 30, 11), {}, ValueError, "max_new_tokens|max_len|prompt"),
    "max_new_tokens=0": (([1, 2], 0), {}, ValueError, "max_new_tokens"),
    "max_new_tokens=-2": (([1, 2], -2), {}, ValueError, "max_new_tokens"),
    "max_new_tokens=1.5": (([1, 2], 1.5), {}, (ValueError, TypeError), "max_new_tokens"),
    "temperature<0": (([1, 2], 2), dict(temperature=-0.5, seed=1), None, "temperature"),
    "temperature=nan": (([1, 2], 2), dict(temperature=math.nan, seed=1), None, "temperature"),
    "top_k=0": (([1, 2], 2), dict(temperature=1.0, top_k=0, seed=1), None, "top_k"),
    "top_k>V": (([1, 2], 2), dict(temperature=1.0, top_k=V + 1, seed=1), None, "top_k"),
    "sampling without seed": (([1, 2], 2), dict(temperature=1.0), None, "seed"),
    "seed=1.5": (([1, 2], 2), dict(temperature=1.0, seed=1.5), None, "seed"),
    "seed='3'": (([1, 2], 2), dict(temperature=1.0, seed="3"), None, "seed"),
}


@pytest.mark.parametrize(
    "args, kwargs, kind, name", REFUSED_REQUESTS.values(), ids=REFUSED_REQUESTS
)
def test_request_refusals_leave_the_engine_unchanged(args, kwargs, kind, name):
    engine = engine_of(num_blocks=10, block_size=4)  # 40 tokens, max_len, per request at most
    first = random_prompts([5])[0]
    engine.add_request(first, 4)
    engine.step()
    before = (stats_of(engine), engine.has_unfinished(), engine.output(0), engine.finished(0))
    with pytest.raises(kind or (ValueError, TypeError), match=name):
        engine.add_request(*args, **kwargs)
    assert (stats_of(engine), engine.has_unfinished(), engine.output(0), engine.finished(0)) == (
        before
    )
    with pytest.raises(KeyError):
        engine.output(1)  # the refused request got no id
    assert engine.add_request([2, 3], 2) == 1
    tokens, _ = drain(engine)
    check_tokens(MODEL, first, before[2] + tokens[0], 4)
    assert stats_of(engine)["prefill_tokens"] + stats_of(engine)["cached_tokens"] == 5 + 2


def test_a_request_that_could_never_fit_the_pool_is_refused():
    engine = engine_of(num_blocks=8, block_size=4)  # 32 tokens
    engine.add_request([1, 2], 2)
    before = stats_of(engine)
    with pytest.raises(ValueError, match="num_blocks|block_size|max_new_tokens|prompt"):
        engine.add_request([1] * 20, 13)  # ceil(33 / 4) = 9 blocks
    assert stats_of(engine) == before and engine.add_request([3], 30) == 1  # 31: 8 blocks


def test_the_limits_are_inclusive():
    engine = engine_of(num_blocks=10, block_size=4)
    prompt = random_prompts([30])[0]
    engine.add_request(prompt, 10)  # 30 + 10 = max_len; ceil(40 / 4) = num_blocks
    check_tokens(MODEL, prompt, drain(engine)[0][0], 10)
    assert stats_of(engine)["peak_blocks"] <= 10


def test_unknown_ids_raise_key_error():
    engine = engine_of()
    for rid in (0, -1):
        with pytest.raises(KeyError):
            engine.output(rid)
        with pytest.raises(KeyError):
            engine.finished(rid)
    engine.add_request([1, 2], 2)
    assert engine.output(0) == [] and engine.finished(0) is False
    for rid in (1, 7):
        with pytest.raises(KeyError):
            engine.output(rid)
        with pytest.raises(KeyError):
            engine.finished(rid)


def test_an_idle_engine_steps_to_nothing():
    engine = engine_of()
    assert engine.has_unfinished() is False
    assert engine.step() == {} and engine.step() == {}
    assert stats_of(engine) == dict.fromkeys(STATS, 0)
    assert all(is_count(v) for v in stats_of(engine).values())


def test_answers_are_lists_of_ints_and_bools():
    engine = engine_of()
    prompts = random_prompts([3, 6])
    for p in prompts:
        engine.add_request(np.array(p, dtype=np.int32), 3)
    assert engine.has_unfinished() is True
    check_step_answer(engine.step())
    out = engine.output(0)
    assert type(out) is list and all(type(t) is int for t in out)
    assert engine.finished(0) is False
    result = engine.run()
    assert type(result) is dict and set(result) >= {0, 1}
    for rid, tokens in result.items():
        assert type(rid) is int and type(tokens) is list
        assert all(type(t) is int for t in tokens)
    assert engine.finished(0) is True and engine.has_unfinished() is False
    assert all(is_count(v) for v in stats_of(engine).values())


def test_prompts_of_any_kind_are_accepted_and_not_mutated():
    prompt = random_prompts([7])[0]
    kinds = [list(prompt), tuple(prompt), np.array(prompt), np.array(prompt, dtype=np.int32)]
    copies = [np.array(k).copy() for k in kinds]
    engine = engine_of()
    for k in kinds:
        engine.add_request(k, 4)
    tokens, _ = drain(engine)
    for rid, (k, copy) in enumerate(zip(kinds, copies)):
        assert np.array_equal(np.array(k), copy)
        check_tokens(MODEL, prompt, tokens[rid], 4)


def test_the_models_parameters_are_never_changed():
    target, draft = make_model(5), make_model(6, d_model=8)
    saved = [{k: v.copy() for k, v in m.params.items()} for m in (target, draft)]
    engine = engine_of(target, draft_model=draft, num_speculative_tokens=2)
    p, q = random_prompts([4, 9])
    engine.add_request(p, 5)
    engine.add_request(q, 5, temperature=0.8, seed=1)
    drain(engine)
    for m, copy in zip((target, draft), saved):
        assert m.params.keys() == copy.keys()
        for name, value in copy.items():
            np.testing.assert_array_equal(m.params[name], value, err_msg=name)


# ---- exactness --------------------------------------------------------------------------------------

# Five requests: 3's prompt begins with 1's, 4's with 0's, so that prefix-cache hits happen.
BASE = random_prompts([3, 9, 5, 4, 2], seed=11)
PROMPTS = [BASE[0], BASE[1], BASE[2], BASE[1] + BASE[3], BASE[0] + BASE[1][:4]]
NEW = [6, 4, 8, 3, 5]  # the longest request: 13 + 3 = 16 tokens


def check_invariants(engine, prompts, new, *, block_size, num_blocks, prefix_caching=True):
    s = stats_of(engine)
    assert s["generated_tokens"] == sum(new)
    assert s["cached_tokens"] % block_size == 0
    assert s["peak_blocks"] <= num_blocks
    assert s["proposed_tokens"] == s["accepted_tokens"] == 0
    if not prefix_caching:
        assert s["cached_tokens"] == 0
    if s["preemptions"] == 0:
        assert s["prefill_tokens"] + s["cached_tokens"] == sum(map(len, prompts))
        assert s["decode_tokens"] == sum(n - 1 for n in new)
    else:
        assert s["prefill_tokens"] + s["cached_tokens"] > sum(map(len, prompts))


CONFIGS = {  # (num_blocks, block_size, max_num_seqs, max_batched_tokens, prefix_caching)
    "roomy": (64, 4, 8, 64, True),
    "no prefix cache": (64, 4, 8, 64, False),
    "blocks of one token": (64, 1, 8, 64, True),
    "blocks longer than prompts": (64, 16, 8, 64, True),
    "two at a time": (64, 4, 2, 64, True),
    "budget of 5": (64, 4, 8, 5, True),
    "three at a time, budget of 7": (64, 2, 3, 7, True),
    "pool of 8 blocks of 2": (8, 2, 8, 64, True),
    "pool of 8, no prefix cache": (8, 2, 8, 64, False),
    "pool of 5 blocks of 4, budget 6": (5, 4, 8, 6, True),
    "one at a time, budget 3": (6, 4, 1, 3, True),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
def test_greedy_tokens_equal_generate(config):
    num_blocks, block_size, max_num_seqs, budget, caching = config
    engine = LLMEngine(
        MODEL,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=budget,
        prefix_caching=caching,
    )
    for p, n in zip(PROMPTS, NEW):
        engine.add_request(p, n)
    tokens, _ = drain(engine)
    for rid, (p, n) in enumerate(zip(PROMPTS, NEW)):
        check_tokens(MODEL, p, tokens[rid], n)
        assert engine.output(rid) == tokens[rid] and engine.finished(rid) is True
    check_invariants(
        engine, PROMPTS, NEW, block_size=block_size, num_blocks=num_blocks, prefix_caching=caching
    )


def test_tight_pools_preempt_and_keep_the_tokens():
    engine = engine_of(num_blocks=8, block_size=2)
    prompts = random_prompts([6, 6, 6, 6], seed=3)
    for p in prompts:
        engine.add_request(p, 9)  # 15 tokens: 8 blocks of 2, the whole pool, each
    tokens, _ = drain(engine)
    for rid, p in enumerate(prompts):
        check_tokens(MODEL, p, tokens[rid], 9)
    assert stats_of(engine)["preemptions"] >= 1
    check_invariants(engine, prompts, [9] * 4, block_size=2, num_blocks=8)


@pytest.mark.parametrize("order", [(4, 3, 2, 1, 0), (2, 0, 4, 1, 3)], ids=str)
def test_arrival_order_changes_no_token(order):
    engine = engine_of(num_blocks=12, block_size=2, max_batched_tokens=6, max_num_seqs=3)
    for i in order:
        engine.add_request(PROMPTS[i], NEW[i])
    tokens, _ = drain(engine)
    for rid, i in enumerate(order):
        check_tokens(MODEL, PROMPTS[i], tokens[rid], NEW[i])


def test_requests_added_between_steps():
    engine = engine_of(block_size=2, max_batched_tokens=8, max_num_seqs=4)
    got = {}
    for rid, (p, n) in enumerate(zip(PROMPTS, NEW)):
        assert engine.add_request(p, n) == rid
        for _ in range(rid % 3):  # 0, 1 or 2 steps before the next arrival
            for r, new in engine.step().items():
                got.setdefault(r, []).extend(new)
    for r, new in drain(engine)[0].items():
        got.setdefault(r, []).extend(new)
    for rid, (p, n) in enumerate(zip(PROMPTS, NEW)):
        check_tokens(MODEL, p, got[rid], n)
        assert engine.output(rid) == got[rid]


OPTIONS = {
    "gqa and sinks": dict(n_heads=4, n_kv_heads=1, sink=True),
    "qk-norm and soft-caps": dict(qk_norm=True, logit_softcap=5.0, attn_softcap=10.0),
    "gate, rms, learned positions": dict(output_gate=True, norm="rms", positional="learned"),
    "no positions, attention only": dict(positional=None, attention_only=True),
    "sinusoidal, float32": dict(positional="sinusoidal", dtype=np.float32),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS)
def test_every_model_option_is_served_exactly(options):
    model = make_model(7, **options)
    engine = engine_of(model, num_blocks=16, block_size=2, max_batched_tokens=6)
    for p, n in zip(PROMPTS[:4], NEW[:4]):
        engine.add_request(p, n)
    tokens, _ = drain(engine)
    for rid, (p, n) in enumerate(zip(PROMPTS[:4], NEW[:4])):
        check_tokens(model, p, tokens[rid], n)


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 3), (2.5, None), (1.2, 1)])
def test_sampled_tokens_equal_generate_with_the_seed(temperature, top_k):
    engine = engine_of(num_blocks=20, block_size=2, max_batched_tokens=7, max_num_seqs=3)
    seeds = [5, 17, 2024, 3, 99]
    for p, n, seed in zip(PROMPTS, NEW, seeds):
        engine.add_request(p, n, temperature=temperature, top_k=top_k, seed=seed)
    tokens, _ = drain(engine)
    for rid, (p, n, seed) in enumerate(zip(PROMPTS, NEW, seeds)):
        check_tokens(MODEL, p, tokens[rid], n, temperature=temperature, top_k=top_k, seed=seed)


def test_greedy_and_sampled_requests_share_a_batch():
    engine = engine_of(block_size=4)
    p = PROMPTS[1]
    engine.add_request(p, 7, temperature=1.5, seed=8)
    engine.add_request(p, 7)
    engine.add_request(p, 7, temperature=1.5, seed=8)
    engine.add_request(p, 7, temperature=1.5, seed=9, top_k=4)
    tokens, _ = drain(engine)
    check_tokens(MODEL, p, tokens[0], 7, temperature=1.5, seed=8)
    check_tokens(MODEL, p, tokens[1], 7)
    assert tokens[2] == tokens[0]  # one seed, one prompt: one draw per token, the same tokens
    check_tokens(MODEL, p, tokens[3], 7, temperature=1.5, top_k=4, seed=9)


# ---- steps, chunks, admission -----------------------------------------------------------------------


def test_stats_start_at_zero():
    engine = engine_of(draft_model=make_model(2), num_speculative_tokens=1)
    assert stats_of(engine) == dict.fromkeys(STATS, 0)


def test_requests_that_fit_finish_in_max_new_tokens_steps():
    engine = engine_of(block_size=4)  # 64 blocks, budget 64 >= 3 + 9 + 5 prompt tokens
    prompts, new = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [1, 4, 7]
    for p, n in zip(prompts, new):
        engine.add_request(p, n)
    for step in range(1, 8):
        answer = engine.step()
        assert sorted(answer) == [rid for rid, n in enumerate(new) if n >= step]
        assert all(len(t) == 1 for t in answer.values())
        assert [engine.finished(rid) for rid in range(3)] == [n <= step for n in new]
    assert engine.has_unfinished() is False
    s = stats_of(engine)
    assert s["steps"] == 7 and s["preemptions"] == 0 and s["cached_tokens"] == 0
    assert s["prefill_tokens"] == 3 + 9 + 5
    assert s["decode_tokens"] == 0 + 3 + 6 and s["generated_tokens"] == 12


def test_steps_count_only_calls_with_work():
    engine = engine_of()
    engine.add_request([1, 2, 3], 3)
    drain(engine)
    assert stats_of(engine)["steps"] == 3
    assert engine.step() == {} and engine.step() == {}
    assert stats_of(engine)["steps"] == 3
    engine.add_request([4, 5], 2)
    drain(engine)
    assert stats_of(engine)["steps"] == 5


def test_a_long_prompt_is_cut_into_chunks_of_the_budget():
    engine = engine_of(block_size=2, max_batched_tokens=4)  # chunks are not cut at blocks
    prompt = random_prompts([10])[0]
    engine.add_request(prompt, 3)
    prefilled, answers = [], []
    for _ in range(5):
        answers.append(engine.step())
        prefilled.append(stats_of(engine)["prefill_tokens"])
    assert engine.has_unfinished() is False
    assert prefilled == [4, 8, 10, 10, 10]  # chunks of 4, 4, 2
    assert [sorted(a) for a in answers] == [
        [],
        [],
        [0],
        [0],
        [0],
    ]  # first token with the last chunk
    check_tokens(MODEL, prompt, engine.output(0), 3)
    assert stats_of(engine)["decode_tokens"] == 2


def test_decode_tokens_go_first_and_chunks_take_what_is_left():
    engine = engine_of(block_size=2, max_batched_tokens=5)
    a, b = random_prompts([3, 9], seed=4)
    engine.add_request(a, 8)
    assert sorted(engine.step()) == [0]
    engine.add_request(b, 2)
    prefilled, decoded, keys = [], [], []
    for _ in range(4):
        keys.append(sorted(engine.step()))
        prefilled.append(stats_of(engine)["prefill_tokens"])
        decoded.append(stats_of(engine)["decode_tokens"])
    assert prefilled == [3 + 4, 3 + 8, 3 + 9, 12]  # chunks of 5 - 1 decode token
    assert decoded == [1, 2, 3, 5]
    assert keys == [[0], [0], [0, 1], [0, 1]]
    drain(engine)
    check_tokens(MODEL, a, engine.output(0), 8)
    check_tokens(MODEL, b, engine.output(1), 2)


def test_waiting_prompts_share_the_budget_in_arrival_order():
    engine = engine_of(block_size=4, max_batched_tokens=6)
    a, b = random_prompts([4, 4], seed=5)
    engine.add_request(a, 2)
    engine.add_request(b, 2)
    assert sorted(engine.step()) == [0]  # 4 tokens of a, 2 of b
    assert stats_of(engine)["prefill_tokens"] == 6
    assert sorted(engine.step()) == [0, 1]  # a's decode token, b's last 2
    assert engine.finished(0) and not engine.finished(1)
    assert sorted(engine.step()) == [1]
    assert stats_of(engine)["steps"] == 3 and engine.has_unfinished() is False
    check_tokens(MODEL, a, engine.output(0), 2)
    check_tokens(MODEL, b, engine.output(1), 2)


@pytest.mark.parametrize(
    "max_num_seqs, new, keys",
    [
        (2, [2, 2, 2, 2], [[0, 1], [0, 1], [2, 3], [2, 3]]),
        (2, [1, 1, 1], [[0, 1], [2]]),  # slots freed in step 1 are not reused in step 1
        (1, [2, 1, 2], [[0], [0], [1], [2], [2]]),
        (3, [3, 1, 2, 1], [[0, 1, 2], [0, 2, 3], [0]]),
    ],
)
def test_max_num_seqs_bounds_every_step(max_num_seqs, new, keys):
    engine = engine_of(max_num_seqs=max_num_seqs)
    prompts = random_prompts([3] * len(new), seed=6)
    for p, n in zip(prompts, new):
        engine.add_request(p, n)
    tokens, answers = drain(engine)
    assert [sorted(a) for a in answers] == keys
    for rid, (p, n) in enumerate(zip(prompts, new)):
        check_tokens(MODEL, p, tokens[rid], n)


def test_admission_does_not_hold_blocks_back_for_growth():
    engine = engine_of(num_blocks=4, block_size=2)
    a, b = random_prompts([2, 2], seed=7)
    engine.add_request(a, 6)  # 8 tokens: the whole pool in the end
    engine.add_request(b, 1)
    assert sorted(engine.step()) == [0, 1]  # b admitted beside a, and done
    drain(engine)
    s = stats_of(engine)
    assert s["preemptions"] == 0 and s["steps"] == 6 and s["peak_blocks"] <= 4
    check_tokens(MODEL, a, engine.output(0), 6)


# ---- blocks, prefix cache, least recently used ------------------------------------------------------


@pytest.mark.parametrize(
    "P, n, block_size, budget",
    [(7, 2, 4, 64), (8, 1, 4, 64), (5, 4, 4, 3), (3, 6, 2, 64), (16, 16, 16, 5), (9, 1, 1, 64)],
)
def test_peak_blocks_of_a_lone_request(P, n, block_size, budget):
    engine = engine_of(block_size=block_size, max_batched_tokens=budget)
    prompt = random_prompts([P], seed=8)[0]
    engine.add_request(prompt, n)
    drain(engine)
    allowed = {math.ceil((P + n - 1) / block_size), math.ceil((P + n) / block_size)}
    assert stats_of(engine)["peak_blocks"] in allowed
    check_tokens(MODEL, prompt, engine.output(0), n)


def run_one(engine, prompt, n):
    """Serve one request alone; return what it added to the counts."""
    before = stats_of(engine)
    rid = engine.add_request(prompt, n)
    drain(engine)
    check_tokens(MODEL, prompt, engine.output(rid), n)
    return {k: v - before[k] for k, v in stats_of(engine).items()}


def test_a_finished_prompts_full_blocks_are_reused():
    engine = engine_of(block_size=4)
    a, extra = random_prompts([12, 2], seed=9)
    run_one(engine, a, 3)
    added = run_one(engine, a[:8] + extra, 3)
    assert added["cached_tokens"] == 8 and added["prefill_tokens"] == 2


@pytest.mark.parametrize("P, cached", [(12, 8), (13, 12), (4, 0)])
def test_a_fully_cached_prompt_computes_its_last_block(P, cached):
    engine = engine_of(block_size=4)
    prompt = random_prompts([P], seed=10)[0]
    run_one(engine, prompt, 2)
    added = run_one(engine, prompt, 2)
    assert added["cached_tokens"] == cached and added["prefill_tokens"] == P - cached


def test_a_block_is_keyed_by_everything_before_it():
    engine = engine_of(block_size=4)
    x, y = random_prompts([8, 4], seed=12)
    assert x[:4] != y
    run_one(engine, x, 2)
    added = run_one(engine, y + x[4:] + [0], 2)  # x's second block after another first block
    assert added["cached_tokens"] == 0 and added["prefill_tokens"] == 9


def test_blocks_holding_generated_tokens_are_never_shared():
    engine = engine_of(block_size=4)
    a = random_prompts([6], seed=13)[0]
    run_one(engine, a, 6)
    g = engine.output(0)
    # a + g covers blocks [a0..a3], [a4 a5 g0 g1], [g2..g5]: only the first is all prompt.
    added = run_one(engine, a + g, 3)
    assert added["cached_tokens"] == 4 and added["prefill_tokens"] == 8


def test_prefix_caching_off_caches_nothing():
    engine = engine_of(block_size=4, prefix_caching=False)
    a = random_prompts([12], seed=9)[0]
    run_one(engine, a, 3)
    added = run_one(engine, a, 3)
    assert added["cached_tokens"] == 0 and added["prefill_tokens"] == 12


def test_two_requests_on_one_cached_prefix_hold_it_once():
    engine = engine_of(block_size=4)
    s = random_prompts([8], seed=14)[0]
    run_one(engine, s, 1)  # leaves s's 2 blocks in the prefix cache
    engine.add_request(s + [1], 3)  # 2 shared blocks + 1 of its own (11 or 12 tokens)
    engine.add_request(s + [2], 3)
    drain(engine)
    check_tokens(MODEL, s + [1], engine.output(1), 3)
    check_tokens(MODEL, s + [2], engine.output(2), 3)
    st = stats_of(engine)
    assert st["cached_tokens"] == 16 and st["peak_blocks"] == 2 + 1 + 1


def test_the_least_recently_used_cached_block_goes_first():
    # 6 blocks of 4. Each 5-token request with one new token holds 2 blocks and leaves its first
    # block cached: a0, b0, c0 in that order, then a0 matched again (a0 now the most recent).
    engine = engine_of(num_blocks=6, block_size=4)
    a, b, c = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 0, 1, 2]
    cached = [run_one(engine, p, 1)["cached_tokens"] for p in (a, b, c, a[:4] + [9])]
    assert cached == [0, 0, 0, 4]
    # 13 tokens take 4 blocks: the 3 free ones and the least recently used cached one, b0.
    d = [4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10]
    assert run_one(engine, d, 1)["cached_tokens"] == 0
    # c0 and a0 survived (each probe takes the one free block); b0 did not.
    cached = [run_one(engine, p, 1)["cached_tokens"] for p in (c[:4] + [7], a[:4] + [8], b)]
    assert cached == [4, 4, 0]
    assert stats_of(engine)["preemptions"] == 0  # cached blocks go before any preemption


def test_preemption_takes_the_most_recently_admitted_request():
    # 6 blocks of 2: each request alone needs all 6 (4 + 8 tokens), both start at once.
    engine = engine_of(num_blocks=6, block_size=2)
    a, b = random_prompts([4, 4], seed=15)
    engine.add_request(a, 8)
    engine.add_request(b, 8)
    order = []
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
        order += [rid for rid in (0, 1) if engine.finished(rid) and rid not in order]
    assert order == [0, 1]  # b, admitted last, gave its blocks back: a was never held up
    check_tokens(MODEL, a, engine.output(0), 8)
    check_tokens(MODEL, b, engine.output(1), 8)
    s = stats_of(engine)
    assert s["preemptions"] >= 1 and s["peak_blocks"] <= 6
    assert s["prefill_tokens"] + s["cached_tokens"] > 8  # b's prompt again
    assert s["generated_tokens"] == 16


# ---- run, step and output -------------------------------------------------------------------------


def test_run_returns_whole_outputs_and_steps_match():
    engine = engine_of(block_size=2, max_batched_tokens=6)
    for p, n in zip(PROMPTS, NEW):
        engine.add_request(p, n)
    pieces = {}
    for _ in range(3):
        for rid, new in engine.step().items():
            pieces.setdefault(rid, []).extend(new)
    early = {rid: engine.output(rid) for rid in range(5)}
    assert early == {rid: pieces.get(rid, []) for rid in range(5)}
    result = engine.run()
    assert set(result) >= set(range(5)) and engine.has_unfinished() is False
    for rid, (p, n) in enumerate(zip(PROMPTS, NEW)):
        assert result[rid][: len(early[rid])] == early[rid]  # tokens from before run() included
        assert result[rid] == engine.output(rid)
        check_tokens(MODEL, p, result[rid], n)
    steps = stats_of(engine)["steps"]
    engine.run()
    assert stats_of(engine)["steps"] == steps


def test_a_finished_request_keeps_its_output():
    engine = engine_of()
    engine.add_request([1, 2, 3], 2)
    engine.add_request([4, 5, 6, 7], 5)
    drain(engine)
    engine.add_request([8], 1)
    engine.run()
    check_tokens(MODEL, [1, 2, 3], engine.output(0), 2)
    check_tokens(MODEL, [4, 5, 6, 7], engine.output(1), 5)
    assert all(engine.finished(rid) for rid in range(3))


# ---- speculative decoding -----------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_target_as_its_own_draft(k):
    engine = engine_of(block_size=4, draft_model=MODEL, num_speculative_tokens=k)
    prompt, n = random_prompts([5], seed=16)[0], 13
    engine.add_request(prompt, n)
    drain(engine)
    check_tokens(MODEL, prompt, engine.output(0), n)
    s = stats_of(engine)
    assert s["steps"] <= 2 + math.ceil((n - 1) / k)
    assert s["proposed_tokens"] >= s["accepted_tokens"] >= n - s["steps"]
    assert s["decode_tokens"] >= n - 1 and s["generated_tokens"] == n
    assert s["prefill_tokens"] == 5


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_another_draft_is_lossless(k):
    draft = make_model(21, d_model=8, n_layers=1)
    engine = engine_of(
        block_size=2,
        max_batched_tokens=12,
        num_blocks=24,
        draft_model=draft,
        num_speculative_tokens=k,
    )
    for p, n in zip(PROMPTS, NEW):
        engine.add_request(p, n)
    tokens, _ = drain(engine)
    for rid, (p, n) in enumerate(zip(PROMPTS, NEW)):
        check_tokens(MODEL, p, tokens[rid], n)
    s = stats_of(engine)
    assert s["proposed_tokens"] > 0 and 0 <= s["accepted_tokens"] <= s["proposed_tokens"]
    assert s["generated_tokens"] == sum(NEW) and s["peak_blocks"] <= 24


def test_the_drafts_cache_lives_outside_the_pool():
    prompt, n = random_prompts([6], seed=17)[0], 10
    engine = engine_of(
        num_blocks=4, block_size=4, draft_model=make_model(22), num_speculative_tokens=3
    )  # 6 + 10 tokens: exactly the 4 blocks of the pool, none left for the draft
    engine.add_request(prompt, n)
    drain(engine)
    check_tokens(MODEL, prompt, engine.output(0), n)
    s = stats_of(engine)
    assert s["preemptions"] == 0 and s["peak_blocks"] <= 4


def test_speculative_sampling_keeps_the_targets_law():
    # Three tokens after [0, 1] on a vocabulary of 3: the first from the prompt's pass, the other
    # two proposed by a draft of other weights, accepted or resampled. Their joint law must be
    # the target's, p(a) p(b | a) p(c | a, b), computed here from its forward pass.
    small = dict(vocab_size=3, d_model=8, n_layers=1, n_heads=2, max_len=8)
    target = DecoderLM(**small, rng=np.random.default_rng(0))
    draft = DecoderLM(**small, rng=np.random.default_rng(100))
    # A sharper draft of other weights: about half its proposals are rejected, so that the
    # resampling from max(0, p - q) decides many tokens (resampling from p instead gives a
    # chi-square near 200 on these seeds, a draft's tokens kept unchecked near 300).
    draft.params["unembedding"] = 3.0 * draft.params["unembedding"]
    prompt, N = [0, 1], 1200

    def law(seq):
        return sampling_law(target.forward(np.array(seq))[-1], 1.0, None)

    p = np.zeros((3, 3, 3))
    for a, b, c in itertools.product(range(3), repeat=3):
        p[a, b, c] = law(prompt)[a] * law(prompt + [a])[b] * law(prompt + [a, b])[c]
    assert N * p.min() >= 10  # every cell expected at least 10 times: the chi-square law holds

    engine = LLMEngine(
        target,
        num_blocks=160,
        block_size=4,
        max_num_seqs=64,
        max_batched_tokens=256,
        draft_model=draft,
        num_speculative_tokens=2,
    )
    for seed in range(N):
        engine.add_request(prompt, 3, temperature=1.0, seed=seed)
    tokens, _ = drain(engine, limit=2000)
    counts = np.zeros((3, 3, 3))
    for rid in range(N):
        counts[tuple(tokens[rid])] += 1
    statistic = float(((counts - N * p) ** 2 / (N * p)).sum())
    threshold = chi2_threshold(26, 1e-6)  # 27 cells, 26 degrees of freedom
    assert statistic < threshold, f"chi-square {statistic:.1f} >= {threshold:.1f}"
    s = stats_of(engine)
    assert 0 < s["accepted_tokens"] < s["proposed_tokens"]  # both branches of the rule ran
