"""Tests of sdpa_book.pages.serving: the traces, the fixed-batch count, the timeline of an
engine's steps and the radix-tree cache model, against hand counts and brute-force references."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa.nn import DecoderLM, LLMEngine
from sdpa_book.pages.serving import (
    RadixCache,
    Request,
    arrival_trace,
    serve_trace,
    static_batching,
)


def test_arrival_trace_draws_within_its_ranges_and_repeats_with_its_seed():
    trace = arrival_trace(200, mean_gap=2.0, prompt_lengths=(3, 9), output_lengths=(1, 5), seed=1)
    arrivals = np.array([r.arrival for r in trace])
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert {r.prompt_len for r in trace} == set(range(3, 10))
    assert {r.output_len for r in trace} == set(range(1, 6))
    # 199 exponential gaps of mean 2: the last arrival near 398 (sd about 28)
    assert 300 < arrivals[-1] < 500
    again = arrival_trace(200, mean_gap=2.0, prompt_lengths=(3, 9), output_lengths=(1, 5), seed=1)
    assert again == trace
    with pytest.raises(ValueError, match="mean_gap"):
        arrival_trace(3, mean_gap=0, prompt_lengths=(1, 2), output_lengths=(1, 2), seed=0)


def test_static_batching_counts_by_hand():
    # Batch 1: requests 0 and 1 (both there at step 0): outputs 3 and 5, so 5 passes, steps
    # 0-4. Request 2 arrived at step 1 and waits; batch 2 runs steps 5-6 (output 2).
    trace = [Request(0, 4, 3), Request(0, 2, 5), Request(1, 3, 2)]
    result = static_batching(trace, batch_size=2)
    assert result.passes == 7 and result.last_step == 6
    assert result.finish == [2, 4, 6]
    assert result.useful == (4 + 2) + (2 + 4) + (3 + 1)
    assert result.computed == 2 * (4 + 4) + 1 * (3 + 1)  # padded to the batch's longest
    # A late arrival: the server idles until step 10.
    late = static_batching([Request(0, 1, 1), Request(10, 1, 2)], batch_size=4)
    assert late.passes == 3 and late.finish == [0, 11] and late.last_step == 11


def _model():
    return DecoderLM(
        vocab_size=13, d_model=16, n_layers=1, n_heads=2, max_len=32, rng=np.random.default_rng(0)
    )


@pytest.mark.parametrize("budget", [3, 8, 64])
def test_serve_trace_timeline_against_generate_and_counts(budget):
    model = _model()
    rng = np.random.default_rng(budget)
    trace = arrival_trace(6, mean_gap=1.5, prompt_lengths=(2, 10), output_lengths=(1, 6), seed=2)
    prompts = [rng.integers(0, 13, r.prompt_len).tolist() for r in trace]
    engine = LLMEngine(
        model, num_blocks=64, block_size=4, max_num_seqs=8, max_batched_tokens=budget
    )
    timeline = serve_trace(engine, prompts, trace)
    for i, (p, r) in enumerate(zip(prompts, trace)):
        want = model.generate(np.array(p), r.output_len, temperature=0)[len(p) :].tolist()
        assert timeline.outputs[i] == want
        steps = timeline.token_steps[i]
        assert len(steps) == r.output_len and steps[0] >= r.arrival
        # every prompt token computed once, and every generated token but the last
        assert timeline.computed[:, i].sum() == r.prompt_len + r.output_len - 1
        assert timeline.computed[timeline.prefill[:, i], i].sum() == r.prompt_len
        # nothing computed before arrival; the first token in the step of the last chunk
        assert timeline.computed[: r.arrival, i].sum() == 0
        last_chunk = np.flatnonzero(timeline.prefill[:, i])[-1]
        assert steps[0] == last_chunk
    assert timeline.computed.sum(axis=1).max() <= budget
    assert len(timeline.emitted) == len(timeline.computed)


def test_serve_trace_refuses_a_draft_engine():
    model = _model()
    engine = LLMEngine(
        model, num_blocks=8, block_size=4, draft_model=model, num_speculative_tokens=1
    )
    with pytest.raises(ValueError, match="draft_model"):
        serve_trace(engine, [[1, 2]], [Request(0, 2, 2)])


class _Reference:
    """A brute-force cache: a set of sequences, the longest common prefix by scanning all."""

    def __init__(self):
        self.seqs = []

    def match(self, tokens):
        best = 0
        for s in self.seqs:
            n = 0
            while n < min(len(s), len(tokens)) and s[n] == tokens[n]:
                n += 1
            best = max(best, n)
        return best


def test_radix_matches_like_brute_force_without_pressure():
    rng = np.random.default_rng(0)
    cache, ref = RadixCache(capacity=10**6), _Reference()
    for _ in range(60):
        base = ref.seqs[rng.integers(len(ref.seqs))] if ref.seqs and rng.random() < 0.7 else []
        keep = int(rng.integers(0, len(base) + 1))
        seq = list(base[:keep]) + rng.integers(0, 3, int(rng.integers(1, 6))).tolist()
        assert cache.match(seq) == ref.match(seq)
        cache.insert(seq)
        ref.seqs.append(seq)
    # the tree holds each distinct prefix once: its size is the number of distinct prefixes
    prefixes = {tuple(s[:n]) for s in ref.seqs for n in range(1, len(s) + 1)}
    assert cache.size == len(prefixes)


def test_radix_serve_counts_and_keeps_generated_tokens():
    cache = RadixCache(capacity=100)
    assert cache.serve([1, 2, 3], [4, 5]) == 0  # keeps 1 2 3 4
    assert cache.size == 4
    # a second turn: the prompt is the first turn's sequence and more
    assert cache.serve([1, 2, 3, 4, 5, 6], [7]) == 4  # 5 was never fed back
    assert cache.serve([1, 2, 3], [9]) == 2  # never the prompt's last token
    assert (cache.hits, cache.computed) == (0 + 4 + 2, 3 + 2 + 1)


def test_radix_evicts_least_recently_used_leaves_first():
    cache = RadixCache(capacity=6)
    cache.insert([1, 2, 3])
    cache.insert([1, 2, 4])  # splits: [1 2] with leaves [3] and [4]; 4 tokens
    cache.insert([5, 6])  # 6 tokens
    cache.match([1, 2, 3])  # leaf [3] used after [4] and [5 6]
    cache.insert([7])  # one over: the least recently used leaf, [4], goes
    assert cache.size == 6
    assert [cache.match(s) for s in ([1, 2, 4], [1, 2, 3], [5, 6], [7])] == [2, 3, 2, 1]
    # Two over: leaf [3] (the oldest use) goes, then its parent [1 2], a leaf now: 3 + 2 left
    cache.insert([8, 9])
    assert cache.size == 5
    assert [cache.match(s) for s in ([1, 2, 3], [5, 6], [7], [8, 9])] == [0, 2, 1, 2]
    # the inserted sequence's own path is never evicted, however old
    small = RadixCache(capacity=3)
    small.insert([1, 2])
    small.insert([1, 2, 3])
    assert small.match([1, 2, 3]) == 3
    with pytest.raises(MemoryError):
        small.insert([1, 2, 3, 4])
    with pytest.raises(ValueError, match="capacity"):
        RadixCache(0)
