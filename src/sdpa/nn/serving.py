r"""Serving a :class:`sdpa.nn.DecoderLM` as inference servers do: :class:`LLMEngine`.

Many requests at once, one batched model pass per step (continuous batching: a request joins
and leaves the batch between any two steps), a paged KV cache with prefix caching
(``sdpa.nn.scheduler``), chunked prefill under a per-step token budget, preemption by
recompute when the pool runs dry, and speculative decoding with a draft model
(``sdpa.nn.speculative``). The pass itself is ``sdpa.nn.packed``: every scheduled token of
every request in one array, each request's attention through its block table.

Every token equals :meth:`sdpa.nn.DecoderLM.generate`'s for the same request alone (greedy,
or sampled with the same seed), up to the rounding of batched products; the tests check it
over many configurations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import ArrayLike

from .._checks import check_bool, check_int, check_positive_int, check_real
from .generation import pick_tokens
from .inputs import check_tokens
from .model import DecoderLM
from .packed import Segment, packed_forward
from .scheduler import BlockPool, block_keys
from .speculative import propose, verify

__all__ = ["EngineStats", "LLMEngine"]


@dataclass
class EngineStats:
    """What an :class:`LLMEngine` did since it was made (every field an ``int``).

    Attributes
    ----------
    steps : int
        :meth:`LLMEngine.step` calls made while work remained.
    prefill_tokens : int
        Prompt tokens computed (recomputed ones after a preemption included).
    cached_tokens : int
        Prompt tokens taken from the prefix cache instead (whole blocks).
    decode_tokens : int
        Tokens the target computed at generated positions, verification of proposals included.
    generated_tokens : int
        Tokens emitted.
    preemptions : int
        Requests preempted (their blocks freed, their tokens recomputed later).
    proposed_tokens, accepted_tokens : int
        Draft proposals, and those the target accepted.
    peak_blocks : int
        The most blocks held by requests at once.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import DecoderLM, LLMEngine
    >>> model = DecoderLM(vocab_size=7, d_model=8, n_layers=1, n_heads=2, max_len=16,
    ...                   rng=np.random.default_rng(0))
    >>> engine = LLMEngine(model, num_blocks=8, block_size=4)
    >>> engine.add_request([1, 2, 3, 4, 5], max_new_tokens=3)
    0
    >>> outputs = engine.run()
    >>> s = engine.stats
    >>> s.prefill_tokens, s.decode_tokens, s.generated_tokens  # 5 prompt tokens, 3 - 1 fed back
    (5, 2, 3)
    """

    steps: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    peak_blocks: int = 0


@dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int | None
    rng: np.random.Generator | None
    prompt_keys: list[bytes]  # hash-chain keys of the prompt's full blocks
    output: list[int] = field(default_factory=list)
    seq: int | None = None  # its sequence in the pool while admitted
    computed: int = 0  # tokens whose keys and values are in the pool
    keys: list[bytes] = field(default_factory=list)  # cached blocks it holds
    hashed: int = 0  # leading prompt blocks matched, registered or passed over
    admitted: int = -1  # admission order

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) == self.max_new_tokens

    @property
    def decoding(self) -> bool:
        """Admitted, and every token but the last one emitted is in the pool."""
        tokens = len(self.prompt) + len(self.output)
        return self.seq is not None and bool(self.output) and self.computed == tokens - 1


@dataclass
class _Work:
    """One request's part of a step: ``count`` tokens from ``computed`` on; with a draft, the
    last emitted token and the proposal."""

    request: _Request
    count: int
    proposal: list[int] = field(default_factory=list)
    dists: list = field(default_factory=list)


class LLMEngine:
    r"""Serve many requests on a :class:`sdpa.nn.DecoderLM`: one batched pass per step.

    Parameters
    ----------
    model : DecoderLM
        The model served (any of its options); its parameters are never changed.
    num_blocks : int
        Blocks in the KV pool (one :class:`sdpa.PagedKVCache` holding every layer).
    block_size : int, default 16
        Token slots per block.
    max_num_seqs : int, default 8
        The most requests admitted at once (and so in one step's pass).
    max_batched_tokens : int, default 64
        The most tokens one step computes: decode tokens (verification included) plus
        prefill chunks.
    prefix_caching : bool, default True
        Keep full blocks of prompt tokens after their request, keyed by a hash chain, and
        reuse them for prompts that begin with the same tokens.
    draft_model : DecoderLM, optional
        Speculative decoding: a model of the same ``vocab_size`` and a ``max_len`` at least the
        target's proposes ``num_speculative_tokens`` tokens per step for every decoding
        request. The target itself is allowed: every proposal is then accepted.
    num_speculative_tokens : int, default 0
        ``k >= 1`` with a draft model, 0 without.

    Attributes
    ----------
    model, draft_model : DecoderLM
    stats : EngineStats
        A snapshot of the counts since construction.

    Raises
    ------
    TypeError
        If ``model`` or ``draft_model`` is not a ``DecoderLM``, a size is not an integer, or
        ``prefix_caching`` is not a bool.
    ValueError
        If a size is not positive, the draft's ``vocab_size`` differs or its ``max_len`` is
        smaller, or ``num_speculative_tokens`` does not fit the draft (``>= 1`` with one,
        ``0`` without).

    Notes
    -----
    **A step** schedules, in this order, until ``max_batched_tokens`` tokens: every decoding
    request (one token, or ``1 + k`` to verify a proposal of ``k``, fewer if the budget is
    short), in admission order; then prefill chunks in arrival order: of admitted requests
    whose prompt is not done, and of waiting requests, admitted while ``max_num_seqs``
    allows and the blocks of their chunk can be had. A chunk is ``min(tokens left, budget
    left)``; the step that computes a prompt's last token emits the request's first token.
    Then one pass over all scheduled tokens (``sdpa.nn.packed``), and each request's new
    keys and values go to the pool (of a proposal, only those of the accepted tokens).

    **Memory.** A block is taken only when a token needs it. When none is free, the least
    recently used cached block that no request holds is evicted; when none is left, the
    most recently admitted request not yet scheduled in this step is preempted: its blocks
    are freed, its tokens (prompt and output so far) recomputed later. No request is admitted
    in a step that preempted one.

    **Exactness.** Greedy tokens equal ``model.generate(prompt, n, temperature=0)``; sampled
    ones (without a draft) equal ``model.generate(prompt, n, temperature=t, top_k=k,
    rng=np.random.default_rng(seed))``: each token is drawn with one uniform number from the
    request's own generator, as ``generate`` draws it. With a draft, each token emitted is
    distributed as the target's (speculative sampling), but the draws differ.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import DecoderLM, LLMEngine
    >>> model = DecoderLM(vocab_size=11, d_model=16, n_layers=2, n_heads=4, max_len=24,
    ...                   rng=np.random.default_rng(0))
    >>> engine = LLMEngine(model, num_blocks=8, block_size=4, max_batched_tokens=16)
    >>> a = engine.add_request([1, 2, 3, 4, 5, 6], 5)
    >>> b = engine.add_request([1, 2, 3, 4, 7], 4, temperature=0.8, seed=3)
    >>> out = engine.run()
    >>> out[a] == model.generate(np.array([1, 2, 3, 4, 5, 6]), 5, temperature=0)[6:].tolist()
    True
    >>> rng = np.random.default_rng(3)
    >>> out[b] == model.generate(np.array([1, 2, 3, 4, 7]), 4, temperature=0.8, rng=rng)[5:].tolist()
    True
    >>> engine.stats.steps, engine.stats.generated_tokens
    (5, 9)
    """

    def __init__(
        self,
        model: DecoderLM,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 8,
        max_batched_tokens: int = 64,
        prefix_caching: bool = True,
        draft_model: DecoderLM | None = None,
        num_speculative_tokens: int = 0,
    ):
        if not isinstance(model, DecoderLM):
            raise TypeError(f"model must be a sdpa.nn.DecoderLM; got {type(model).__name__}")
        num_blocks = check_positive_int(num_blocks, "num_blocks")
        block_size = check_positive_int(block_size, "block_size")
        self.max_num_seqs = check_positive_int(max_num_seqs, "max_num_seqs")
        self.max_batched_tokens = check_positive_int(max_batched_tokens, "max_batched_tokens")
        self.prefix_caching = check_bool(prefix_caching, "prefix_caching")
        self.num_speculative_tokens = _check_draft(model, draft_model, num_speculative_tokens)
        self.model, self.draft_model = model, draft_model
        self.num_blocks, self.block_size = num_blocks, block_size
        self._pool = BlockPool(model, num_blocks, block_size)
        self._requests: list[_Request] = []  # by id
        self._waiting: list[_Request] = []  # by id (arrival)
        self._running: list[_Request] = []  # by admission
        self._admissions = 0
        self._stats = EngineStats()

    def __repr__(self) -> str:
        return (
            f"LLMEngine(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"max_num_seqs={self.max_num_seqs}, max_batched_tokens={self.max_batched_tokens}, "
            f"prefix_caching={self.prefix_caching}, "
            f"num_speculative_tokens={self.num_speculative_tokens}, "
            f"requests={len(self._requests)})"
        )

    @property
    def stats(self) -> EngineStats:
        return replace(self._stats)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: ArrayLike,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> int:
        """Queue a request; return its id (0, 1, 2, ... in the order added).

        Parameters
        ----------
        prompt : (P,) array_like of int
            Token ids in ``[0, vocab_size)``, ``P >= 1``.
        max_new_tokens : int
            Tokens to generate, ``>= 1``; ``P + max_new_tokens <= model.max_len``, and the
            request must fit in the pool alone (``ceil((P + max_new_tokens) / block_size) <=
            num_blocks``).
        temperature : float, default 0.0
            0: greedy; otherwise sampled as :meth:`sdpa.nn.DecoderLM.generate` samples.
        top_k : int, optional
            Sample among the ``top_k`` most likely tokens only, ``1 <= top_k <= vocab_size``.
        seed : int, optional
            Required when ``temperature > 0``: the request draws from
            ``np.random.default_rng(seed)``.

        Returns
        -------
        request_id : int

        Raises
        ------
        TypeError
            If ``prompt`` is not of integers, a number is of the wrong kind, or ``seed`` is
            missing when sampling.
        ValueError
            If an argument is out of range (see above); the engine is unchanged.
        """
        tokens, one_d = check_tokens(prompt, "prompt", self.model.config)
        if not one_d:
            raise ValueError(f"prompt must be 1-D (P,); got shape {np.shape(prompt)}")
        P = tokens.shape[1]
        n = check_int(max_new_tokens, "max_new_tokens", minimum=1)
        if P + n > self.model.max_len:
            raise ValueError(
                f"len(prompt)={P} plus max_new_tokens={n} exceed the model's max_len="
                f"{self.model.max_len}"
            )
        if math.ceil((P + n) / self.block_size) > self.num_blocks:
            raise ValueError(
                f"len(prompt)={P} plus max_new_tokens={n} need "
                f"{math.ceil((P + n) / self.block_size)} blocks of {self.block_size}, more "
                f"than the pool's num_blocks={self.num_blocks}"
            )
        temperature = check_real(
            temperature, "temperature", "a finite real number >= 0", lambda t: 0 <= t < math.inf
        )
        if top_k is not None:
            top_k = check_int(top_k, "top_k", minimum=1)
            if top_k > self.model.vocab_size:
                raise ValueError(
                    f"top_k must be in [1, vocab_size={self.model.vocab_size}]; got {top_k}"
                )
        if seed is not None:
            seed = check_int(seed, "seed")
        elif temperature > 0:
            raise TypeError("sampling (temperature > 0) needs seed=, an int; got seed=None")
        prompt = [int(t) for t in tokens[0]]
        rng = None if seed is None else np.random.default_rng(seed)
        keys = block_keys(prompt, self.block_size, P // self.block_size)
        request = _Request(len(self._requests), prompt, n, temperature, top_k, rng, keys)
        self._requests.append(request)
        self._waiting.append(request)
        return request.id

    def _request(self, request_id) -> _Request:
        if (
            isinstance(request_id, (bool, np.bool_))
            or not isinstance(request_id, (int, np.integer))
            or not 0 <= request_id < len(self._requests)
        ):
            raise KeyError(f"request_id {request_id!r} is not a request of this engine")
        return self._requests[int(request_id)]

    def output(self, request_id: int) -> list[int]:
        """The tokens request ``request_id`` generated so far (``KeyError`` if unknown)."""
        return list(self._request(request_id).output)

    def finished(self, request_id: int) -> bool:
        """Whether request ``request_id`` has all its tokens (``KeyError`` if unknown)."""
        return self._request(request_id).finished

    def has_unfinished(self) -> bool:
        """Whether some request still has tokens to generate."""
        return bool(self._waiting or self._running)

    def run(self) -> dict[int, list[int]]:
        """Step until every request is finished; every request's generated tokens, by id."""
        while self.has_unfinished():
            self.step()
        return {r.id: list(r.output) for r in self._requests}

    # -- a step ------------------------------------------------------------------------------

    def step(self) -> dict[int, list[int]]:
        """One scheduler iteration and one batched pass; the tokens each request emitted."""
        if not self.has_unfinished():
            return {}
        self._stats.steps += 1
        plan = self._schedule()
        if not plan:  # cannot happen: the first waiting request always fits an idle pool
            raise RuntimeError("the engine scheduled nothing while work remained")
        return self._execute(plan)

    def _schedule(self) -> list[_Work]:
        budget, plan, scheduled, preempted = self.max_batched_tokens, [], set(), False
        for r in [r for r in self._running if r.decoding]:
            if budget < 1:
                break
            if r.seq is None:  # preempted for an earlier request of this step
                continue
            k = 0
            if self.draft_model is not None:
                k = max(0, min(self.num_speculative_tokens, r.max_new_tokens - len(r.output) - 1, budget - 1))  # fmt: skip
            if not self._room(r, 1 + k, scheduled):
                preempted = True
                continue
            work = _Work(r, 1 + k)
            if k:
                work.proposal, work.dists = propose(
                    self.draft_model, r.tokens, k, r.temperature, r.top_k, r.rng
                )
            plan.append(work)
            scheduled.add(r.id)
            budget -= 1 + k
        admitting = True
        pending = [r for r in self._running if not r.decoding] + self._waiting
        for r in sorted(pending, key=lambda r: r.id):
            if budget < 1:
                break
            count = min(len(r.tokens) - r.computed, budget)
            if r.seq is None:  # waiting (or preempted in this step)
                admitting = admitting and not preempted
                if not admitting or len(self._running) >= self.max_num_seqs:
                    continue
                if not self._admit(r, budget):
                    admitting = False  # first come, first served: none overtakes it
                    continue
                count = min(len(r.tokens) - r.computed, budget)  # after its cached blocks
            elif not self._room(r, count, scheduled):
                preempted = True
                continue
            plan.append(_Work(r, count))
            scheduled.add(r.id)
            budget -= count
        return plan

    def _room(self, r: _Request, count: int, scheduled: set) -> bool:
        """Reserve the blocks ``count`` more tokens of ``r`` need, preempting the most recently
        admitted unscheduled requests while the pool is short; False if ``r`` itself was."""
        pool = self._pool
        need = pool.blocks_for(r.computed + count) - pool.blocks_for(r.computed)
        while not pool.reserve(need):
            victim = max(
                (v for v in self._running if v.id not in scheduled), key=lambda v: v.admitted
            )
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _preempt(self, r: _Request) -> None:
        self._pool.release(r.seq, r.keys)
        r.seq, r.computed, r.keys, r.hashed = None, 0, [], 0
        self._running.remove(r)
        self._waiting.append(r)
        self._waiting.sort(key=lambda w: w.id)
        self._stats.preemptions += 1

    def _admit(self, r: _Request, budget: int) -> bool:
        """Admit waiting ``r`` if the blocks of its first chunk can be had (with its cached
        prefix blocks first); reserve them."""
        pool, total = self._pool, len(r.tokens)
        # Only whole prompt blocks, and never the last token: its logits are needed.
        usable = min(len(r.prompt_keys), (total - 1) // self.block_size)
        matched = pool.match(r.prompt_keys[:usable]) if self.prefix_caching else []
        start = len(matched) * self.block_size
        count = min(total - start, budget)
        need = pool.blocks_for(start + count) - len(matched)
        if need > pool.obtainable(matched):
            return False
        r.seq = pool.start(matched)
        pool.reserve(need)  # cannot fail: checked above
        r.keys, r.hashed, r.computed = list(matched), len(matched), start
        r.admitted, self._admissions = self._admissions, self._admissions + 1
        self._stats.cached_tokens += start
        self._waiting.remove(r)
        self._running.append(r)
        return True

    def _execute(self, plan: list[_Work]) -> dict[int, list[int]]:
        tokens, positions, segments, rows = [], [], [], []
        for w in plan:
            r, offset = w.request, len(tokens)
            new = r.tokens[r.computed : r.computed + w.count - len(w.proposal)] + w.proposal
            tokens += new
            positions += range(r.computed, r.computed + w.count)
            segments.append(Segment(offset, len(tokens), *self._pool.read(r.seq)))
            if w.proposal:  # the logits at the last token and at every proposal
                rows += range(offset, len(tokens))
            elif r.computed + w.count == len(r.tokens):  # the last one: the next token's
                rows.append(len(tokens) - 1)
        logits, keys, values = packed_forward(
            self.model,
            np.asarray(tokens),
            np.asarray(positions),
            segments,
            np.asarray(rows, dtype=np.intp),
        )
        emitted, row = {}, 0
        for w, seg in zip(plan, segments):
            r = w.request
            out = []
            if w.proposal:
                out = verify(
                    logits[row : row + w.count], w.proposal, w.dists, r.temperature, r.top_k, r.rng
                )
                row += w.count
                self._stats.proposed_tokens += len(w.proposal)
                self._stats.accepted_tokens += len(out) - 1
            elif r.computed + w.count == len(r.tokens):
                out = [int(pick_tokens(logits[row : row + 1], r.temperature, r.top_k, r.rng)[0])]
                row += 1
            kept = len(out) if w.proposal else w.count  # a proposal's rejected tokens are not
            a = seg.start
            self._pool.write(r.seq, keys[:, :, a : a + kept], values[:, :, a : a + kept])
            prompt_part = max(0, min(len(r.prompt), r.computed + w.count) - r.computed)
            self._stats.prefill_tokens += prompt_part
            self._stats.decode_tokens += w.count - prompt_part
            r.computed += kept
            self._register(r)
            if out:
                r.output += out
                emitted[r.id] = list(out)
                self._stats.generated_tokens += len(out)
        self._pool.reserved = 0
        self._stats.peak_blocks = max(self._stats.peak_blocks, self._pool.in_use())
        for w in plan:
            if w.request.finished:
                self._finish(w.request)
        return emitted

    def _register(self, r: _Request) -> None:
        """Put the prompt blocks ``r`` has just filled into the prefix cache."""
        full = min(r.computed, len(r.prompt)) // self.block_size
        for j in range(r.hashed, full if self.prefix_caching else 0):
            if self._pool.register(r.prompt_keys[j], r.seq, j):
                r.keys.append(r.prompt_keys[j])
        r.hashed = max(r.hashed, full)

    def _finish(self, r: _Request) -> None:
        self._pool.release(r.seq, r.keys)
        r.seq, r.keys = None, []
        self._running.remove(r)


def _check_draft(model: DecoderLM, draft, k) -> int:
    """``num_speculative_tokens`` checked against the draft model (or its absence)."""
    k = check_int(k, "num_speculative_tokens", minimum=0)
    if draft is None:
        if k:
            raise ValueError(f"num_speculative_tokens must be 0 without a draft_model; got {k}")
        return 0
    if not isinstance(draft, DecoderLM):
        raise TypeError(f"draft_model must be a sdpa.nn.DecoderLM; got {type(draft).__name__}")
    if draft.vocab_size != model.vocab_size or draft.max_len < model.max_len:
        raise ValueError(
            f"draft_model must have the model's vocab_size={model.vocab_size} and a max_len "
            f">= {model.max_len}; got vocab_size={draft.vocab_size}, max_len={draft.max_len}"
        )
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1 with a draft_model; got {k}")
    return k
