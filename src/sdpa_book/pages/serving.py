"""Traces, schedules and a radix-tree cache for the pages of Part IX, *Serving the model*.

The pages run :class:`sdpa.nn.LLMEngine` on the book's trained model; this module holds what
they need around it and would only clutter them:

* :func:`arrival_trace` draws requests (arrival step, prompt and output lengths) from stated
  distributions, seeded; :func:`static_batching` counts the passes a server that runs fixed
  batches needs for it;
* :func:`serve_trace` feeds a trace to an engine, each request at its arrival step, and records
  what every step did (:class:`Timeline`): the tokens each request emitted and the tokens of
  each request the step computed, reconstructed from the engine's public statistics and the
  scheduling order its contract fixes (decode tokens first, then prefill chunks by arrival);
* :class:`RadixCache` is a small model of SGLang's radix tree of cached tokens: token-level
  matching, every computed token kept (generated ones included), least recently used leaves
  evicted first under a capacity in tokens.

>>> trace = arrival_trace(4, mean_gap=1.0, prompt_lengths=(2, 6), output_lengths=(1, 4), seed=0)
>>> [r.arrival for r in trace] == sorted(r.arrival for r in trace)
True
>>> cache = RadixCache(capacity=16)
>>> cache.serve([1, 2, 3, 4], [5, 6])     # nothing cached yet; keeps 1 2 3 4 5
0
>>> cache.serve([1, 2, 3, 4, 5, 6, 7], [8])    # the first five tokens come from the cache
5
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "RadixCache",
    "Request",
    "StaticBatching",
    "Timeline",
    "arrival_trace",
    "serve_trace",
    "static_batching",
]


@dataclass(frozen=True)
class Request:
    """One request of a trace: the step it arrives at, its prompt's and its output's lengths."""

    arrival: int
    prompt_len: int
    output_len: int


def arrival_trace(
    n: int,
    *,
    mean_gap: float,
    prompt_lengths: tuple[int, int],
    output_lengths: tuple[int, int],
    seed: int,
) -> list[Request]:
    """``n`` requests: arrivals a Poisson process, lengths uniform.

    Parameters
    ----------
    n : int
        Requests.
    mean_gap : float
        Mean gap between arrivals, in steps: gaps are exponential, arrival steps are the
        running sums rounded down (several requests may arrive at one step). The first
        request arrives at step 0.
    prompt_lengths, output_lengths : (int, int)
        Inclusive ranges of the uniform prompt and output lengths.
    seed : int
        Seed of ``np.random.default_rng``.

    Returns
    -------
    list of Request
        In arrival order.
    """
    if n < 1 or mean_gap <= 0:
        raise ValueError(f"n must be >= 1 and mean_gap > 0; got n={n}, mean_gap={mean_gap}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(mean_gap, n)
    gaps[0] = 0.0
    arrivals = np.floor(np.cumsum(gaps)).astype(int)
    prompts = rng.integers(prompt_lengths[0], prompt_lengths[1] + 1, n)
    outputs = rng.integers(output_lengths[0], output_lengths[1] + 1, n)
    return [Request(int(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


@dataclass
class StaticBatching:
    """What fixed batches cost for a trace (see :func:`static_batching`).

    Attributes
    ----------
    passes : int
        Model passes (steps) run.
    last_step : int
        The step at whose end the last request finishes (idle steps count too).
    finish : list of int
        Each request's finishing step, in trace order.
    computed, useful : int
        Token slots the passes computed (padding included), and those that were needed.
    """

    passes: int
    last_step: int
    finish: list[int]
    computed: int
    useful: int


def static_batching(trace: list[Request], batch_size: int) -> StaticBatching:
    """Serve ``trace`` in fixed batches: a batch runs until its longest request is done.

    When the server is idle it takes the (up to) ``batch_size`` earliest requests that have
    arrived, pads their prompts to the longest, and runs one pass over the prompts (which gives
    every request its first token) and then one pass per further token of the longest output;
    no request joins or leaves the batch meanwhile. Each pass takes one step.

    Parameters
    ----------
    trace : list of Request
    batch_size : int

    Returns
    -------
    StaticBatching
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival, i))
    finish = [0] * len(trace)
    step = passes = computed = useful = 0
    while order:
        step = max(step, trace[order[0]].arrival)
        batch = [i for i in order if trace[i].arrival <= step][:batch_size]
        order = [i for i in order if i not in batch]
        longest_out = max(trace[i].output_len for i in batch)
        longest_prompt = max(trace[i].prompt_len for i in batch)
        for i in batch:
            finish[i] = step + trace[i].output_len - 1
            useful += trace[i].prompt_len + trace[i].output_len - 1
        computed += len(batch) * (longest_prompt + longest_out - 1)
        passes += longest_out
        step += longest_out
    return StaticBatching(passes, step - 1, finish, computed, useful)


@dataclass
class Timeline:
    """What each step of :func:`serve_trace` did.

    Attributes
    ----------
    computed : (steps, requests) np.ndarray of int
        Tokens of each request the step's pass computed.
    prefill : (steps, requests) np.ndarray of bool
        Whether those tokens were prompt tokens (a prefill chunk) rather than a decode token.
    emitted : list of dict
        What :meth:`sdpa.nn.LLMEngine.step` returned, step by step.
    outputs : dict
        Every request's generated tokens, by id.
    token_steps : list of list of int
        For each request, the step that emitted each of its tokens.
    """

    computed: np.ndarray
    prefill: np.ndarray
    emitted: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    token_steps: list = field(default_factory=list)


def serve_trace(engine, prompts: list, trace: list[Request]) -> Timeline:
    """Run ``engine`` over a trace: request ``i`` (prompt ``prompts[i]``) added at its arrival.

    Step ``s`` first adds the requests arriving at ``s``, then calls ``engine.step()``; a step
    with nothing to do is still a step of the timeline (time passes). The tokens each request
    computed in a step are reconstructed from the statistics: a request that had emitted and
    emits again computed one decode token; the step's prefill tokens go to the requests with
    prompt tokens left, in arrival order, each ``min(left, what remains)``, as the engine's
    contract orders them. The reconstruction is checked: a request's prompt is complete in the
    step where it emits its first token, and never before.

    Parameters
    ----------
    engine : sdpa.nn.LLMEngine
        A fresh engine, without a draft model, whose pool and ``max_num_seqs`` hold every
        request admitted (no preemption; checked).
    prompts : list of sequences of int
    trace : list of Request
        Arrivals in non-decreasing order; ``output_len`` is each request's ``max_new_tokens``.

    Returns
    -------
    Timeline
    """
    if engine.draft_model is not None:
        raise ValueError("serve_trace: an engine without a draft_model is expected")
    n = len(trace)
    left = [len(p) for p in prompts]  # prompt tokens not yet computed
    rows, kinds, emitted, token_steps = [], [], [], [[] for _ in range(n)]
    added, step, before = 0, 0, engine.stats
    while added < n or engine.has_unfinished():
        while added < n and trace[added].arrival <= step:
            engine.add_request(prompts[added], trace[added].output_len)
            added += 1
        out = engine.step()
        stats = engine.stats
        row, kind = np.zeros(n, dtype=int), np.zeros(n, dtype=bool)
        for r in out:
            if token_steps[r]:
                row[r] = 1  # a decode token
        budget = stats.prefill_tokens - before.prefill_tokens
        for r in range(added):
            if budget and left[r]:
                chunk = min(left[r], budget)
                row[r], kind[r], left[r], budget = chunk, True, left[r] - chunk, budget - chunk
                if (left[r] == 0) != (r in out and not token_steps[r]):
                    raise RuntimeError(f"step {step}: request {r}'s chunks do not add up")
        if (
            budget
            or stats.preemptions
            or row.sum()
            != (
                stats.prefill_tokens
                + stats.decode_tokens
                - before.prefill_tokens
                - before.decode_tokens
            )
        ):
            raise RuntimeError(f"step {step}: the step's tokens do not add up")
        for r, tokens in out.items():
            token_steps[r] += [step] * len(tokens)
        rows.append(row)
        kinds.append(kind)
        emitted.append(out)
        before, step = stats, step + 1
    outputs = {r: engine.output(r) for r in range(n)}
    return Timeline(np.array(rows), np.array(kinds), emitted, outputs, token_steps)


class _Node:
    __slots__ = ("children", "last_used", "parent", "tokens")

    def __init__(self, tokens: tuple, parent):
        self.tokens, self.parent, self.children, self.last_used = tokens, parent, {}, 0


class RadixCache:
    """A model of SGLang's radix tree of cached keys and values, counted in tokens.

    Every edge holds a run of tokens; a path from the root spells a cached sequence. A request
    reuses the longest cached prefix of its prompt, token by token (all but the prompt's last
    token, whose logits are needed), and afterwards its whole sequence is kept: prompt and
    generated tokens (all but the last generated one, never fed back). When the tree would
    exceed ``capacity`` tokens, leaves that the current request does not use are evicted, least
    recently used first; a parent left childless becomes a leaf in turn.

    Parameters
    ----------
    capacity : int
        Tokens the tree may hold (the memory of the KV pool).

    Attributes
    ----------
    size : int
        Tokens held.
    hits, computed : int
        Prompt tokens served from the tree, and prompt tokens computed, over all requests.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1; got {capacity}")
        self.capacity, self.size, self.hits, self.computed = capacity, 0, 0, 0
        self._root, self._clock = _Node((), None), 0

    def _walk(self, tokens: list) -> tuple[int, list]:
        """The length of the longest cached prefix of ``tokens`` and the nodes it passes."""
        node, matched, path = self._root, 0, []
        while matched < len(tokens) and tokens[matched] in node.children:
            child = node.children[tokens[matched]]
            run = 0
            while (
                run < len(child.tokens)
                and matched + run < len(tokens)
                and child.tokens[run] == tokens[matched + run]
            ):
                run += 1
            path.append(child)
            matched += run
            if run < len(child.tokens):
                break
            node = child
        return matched, path

    def match(self, tokens: list) -> int:
        """Tokens of ``tokens`` cached as a prefix; marks them used now."""
        matched, path = self._walk(list(tokens))
        self._clock += 1
        for node in path:
            node.last_used = self._clock
        return matched

    def _evict(self, need: int, keep: set) -> None:
        while self.size + need > self.capacity:
            leaves = [n for n in self._nodes() if not n.children and n not in keep]
            if not leaves:
                raise MemoryError(f"cannot free {need} tokens: every leaf is in use")
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.tokens[0]]
            self.size -= len(victim.tokens)

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def insert(self, tokens: list) -> None:
        """Cache ``tokens`` (a sequence from the start), evicting old leaves if needed."""
        tokens = list(tokens)
        matched, path = self._walk(tokens)
        self._clock += 1
        node = self._root
        if path:  # split the last edge where the match ends inside it
            last = path[-1]
            depth = matched - sum(len(n.tokens) for n in path[:-1])
            if depth < len(last.tokens):
                head = _Node(last.tokens[:depth], last.parent)
                last.parent.children[head.tokens[0]] = head
                last.tokens, last.parent = last.tokens[depth:], head
                head.children[last.tokens[0]] = last
                head.last_used = last.last_used
                path[-1] = head
            node = path[-1]
        for n in path:
            n.last_used = self._clock
        rest = tuple(tokens[matched:])
        if rest:
            keep, walk = set(path), node
            while walk is not None:  # the path to the root stays: the request uses it
                keep.add(walk)
                walk = walk.parent
            self._evict(len(rest), keep)
            leaf = _Node(rest, node)
            leaf.last_used = self._clock
            node.children[rest[0]] = leaf
            self.size += len(rest)

    def serve(self, prompt: list, output: list) -> int:
        """One request: match its prompt (all but the last token), then keep its sequence.

        Returns the prompt tokens taken from the cache.
        """
        prompt, output = list(prompt), list(output)
        hit = self.match(prompt[:-1])
        self.hits += hit
        self.computed += len(prompt) - hit
        self.insert(prompt + output[:-1])
        return hit
