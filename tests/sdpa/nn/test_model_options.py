"""sdpa.nn.DecoderLM's stability and sink options: ``qk_norm``, ``logit_softcap``,
``attn_softcap``, ``sink`` and ``output_gate``.

Each option's loss gradient is checked against central finite differences and against
``torch.autograd`` on a torch model written out here from the formulas (independent of the
package: its own RoPE, attention, sink column and gate); generation with and without the KV
cache must agree; hand-checked cases pin each option's meaning; the defaults leave the plain
model unchanged bit for bit; every bad argument raises.
"""

from __future__ import annotations

import copy
import hashlib
import math

import numpy as np
import pytest
from nn_checks import assert_grads_match_differences

from sdpa import nn

V, E, MAX_LEN = 7, 8, 6

# Each option alone (on different base models), then all of them together.
CONFIGS = {
    "qk_norm-rope-layer": dict(qk_norm=True),
    "qk_norm-gqa-rms": dict(qk_norm=True, norm="rms", n_heads=4, n_kv_heads=2),
    "logit_softcap-rope-layer": dict(logit_softcap=1.5),
    "logit_softcap-learned-rms": dict(logit_softcap=0.7, positional="learned", norm="rms"),
    "attn_softcap-rope-layer": dict(attn_softcap=0.8),
    "attn_softcap-gqa-learned": dict(
        attn_softcap=1.2, positional="learned", n_heads=4, n_kv_heads=2
    ),
    "sink-rope-layer": dict(sink=True),
    "sink-mqa-rms-attention-only": dict(
        sink=True, norm="rms", n_heads=4, n_kv_heads=1, attention_only=True
    ),
    "sink-attn_softcap-gqa": dict(sink=True, attn_softcap=0.9, n_heads=4, n_kv_heads=2),
    "output_gate-rope-layer": dict(output_gate=True),
    "output_gate-mqa-learned-attention-only": dict(
        output_gate=True, positional="learned", n_heads=2, n_kv_heads=1, attention_only=True
    ),
    "everything-gqa-rope-rms": dict(
        qk_norm=True,
        logit_softcap=2.0,
        attn_softcap=1.1,
        sink=True,
        output_gate=True,
        norm="rms",
        n_heads=4,
        n_kv_heads=2,
    ),
}


def make_model(seed=0, perturb=True, **overrides):
    """A float64 model with random norm gains and biases (QK-norm's gains too) and random sink
    logits, so that no gradient is tested at a special point (as initialised without
    ``perturb``)."""
    config = dict(
        vocab_size=V,
        d_model=E,
        n_layers=2,
        n_heads=2,
        d_ff=12,
        max_len=MAX_LEN,
        rng=np.random.default_rng(seed),
    )
    config.update(overrides)
    model = nn.DecoderLM(**config)
    if not perturb:
        return model
    rng, sink_rng = np.random.default_rng(seed + 1), np.random.default_rng(seed + 2)
    for name, p in model.params.items():  # the plain parameters as in a model without sinks
        if "norm" in name:
            p += 0.3 * rng.standard_normal(p.shape).astype(p.dtype)
        elif name.endswith("attn.sink"):
            p += sink_rng.standard_normal(p.shape).astype(p.dtype)
    return model


@pytest.fixture
def batch(rng):
    tokens = rng.integers(0, V, size=(2, 5))
    targets = rng.integers(0, V, size=(2, 5))
    return tokens, targets


# ---------------------------------------------------------------------------------------------
# Gradients: central finite differences and torch.autograd
# ---------------------------------------------------------------------------------------------


def is_new(name: str) -> bool:
    """The parameters the options add."""
    return any(part in name for part in ("q_norm", "k_norm", "attn.sink", "attn.w_g"))


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_loss_and_grads_match_finite_differences(config, batch):
    """The options' parameters entry by entry (up to 8 entries each); every parameter along a
    random direction; a few entries of each plain parameter."""
    entries = lambda name: (8, 8) if is_new(name) else (2, 2)  # noqa: E731
    assert_grads_match_differences(make_model(**config), *batch, entries)


def test_the_options_parameters_all_get_a_gradient(batch):
    """A parameter the forward pass forgot would pass the finite differences with a zero
    gradient: every entry of the new parameters must move the loss."""
    model = make_model(**CONFIGS["everything-gqa-rope-rms"])
    _, grads = model.loss_and_grads(*batch)
    new = [name for name in grads if is_new(name)]
    assert len(new) == 8
    for name in new:
        assert np.all(grads[name] != 0), name


def torch_loss(torch, model, tokens, targets):
    """The model's loss written out in torch from the formulas, and its parameters as leaf
    tensors: RoPE in the halves layout, attention as an explicit softmax (with the sink as an
    extra column, dropped), the output gate, the soft-caps."""
    F = torch.nn.functional
    P = {name: torch.tensor(p, requires_grad=True) for name, p in model.params.items()}
    B, T = tokens.shape
    Hq, Hkv, Dk = model.n_heads, model.n_kv_heads, model.head_dim
    tokens = torch.from_numpy(tokens)

    def norm(x, prefix):
        if model.norm == "layer":
            return F.layer_norm(x, (E,), P[prefix + ".weight"], P[prefix + ".bias"], eps=1e-5)
        return F.rms_norm(x, (E,), P[prefix + ".weight"], eps=1e-6)

    def rope(x):  # (B, H, T, Dk): pairs (x[j], x[j + Dk/2]) rotated by t * 10000^(-2j/Dk)
        freq = 10000.0 ** (-torch.arange(0, Dk, 2, dtype=torch.float64) / Dk)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * freq  # (T, Dk/2)
        a, b = x[..., : Dk // 2], x[..., Dk // 2 :]
        return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)

    def split(x, H):  # (B, T, H Dk) -> (B, H, T, Dk)
        return x.reshape(B, T, H, Dk).transpose(1, 2)

    x = P["token_embedding"][tokens]
    if model.positional == "learned":
        x = x + P["position_embedding"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(model.n_layers):
        p = f"blocks.{i}."
        h = norm(x, p + "attn_norm")
        q = split(h @ P[p + "attn.w_q"], Hq)
        k = split(h @ P[p + "attn.w_k"], Hkv)
        v = split(h @ P[p + "attn.w_v"], Hkv)
        if model.qk_norm:
            q = F.rms_norm(q, (Dk,), P[p + "attn.q_norm.weight"], eps=1e-6)
            k = F.rms_norm(k, (Dk,), P[p + "attn.k_norm.weight"], eps=1e-6)
        if model.positional == "rope":
            q, k = rope(q), rope(k)
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # query head h reads key/value head h // G
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(Dk)  # (B, Hq, T, T)
        cap = getattr(model, "attn_softcap", None)
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(~causal, -torch.inf)
        if getattr(model, "sink", False):
            sink = P[p + "attn.sink"].reshape(1, Hq, 1, 1).expand(B, Hq, T, 1)
            scores = torch.cat([scores, sink], dim=-1)  # one more column ...
        weights = torch.softmax(scores, dim=-1)[..., :T]  # ... in the denominator only
        heads = (weights @ v).transpose(1, 2).reshape(B, T, Hq * Dk)
        if getattr(model, "output_gate", False):
            heads = heads * torch.sigmoid(h @ P[p + "attn.w_g"])
        x = x + heads @ P[p + "attn.w_o"]
        if not model.attention_only:
            u = norm(x, p + "mlp_norm") @ P[p + "mlp.w_in"] + P[p + "mlp.b_in"]
            x = x + F.gelu(u, approximate="tanh") @ P[p + "mlp.w_out"] + P[p + "mlp.b_out"]
    logits = norm(x, "final_norm") @ P["unembedding"]
    cap = getattr(model, "logit_softcap", None)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    loss = F.cross_entropy(logits.reshape(-1, V), torch.from_numpy(targets).reshape(-1))
    return loss, P


@pytest.mark.parametrize(
    "config",
    [{}, dict(positional="learned", attention_only=True), *CONFIGS.values()],
    ids=["plain-rope-layer", "plain-learned-attention-only", *CONFIGS],
)
def test_loss_and_grads_match_torch(torch, config, batch):
    """The plain model first: it shows that the torch model is written in the same
    conventions (RoPE's layout, the grouping of heads)."""
    model = make_model(**config)
    tokens, targets = batch
    loss, grads = model.loss_and_grads(tokens, targets)
    t_loss, P = torch_loss(torch, model, tokens, targets)
    t_loss.backward()
    assert loss == pytest.approx(t_loss.item(), rel=1e-12)
    for name, g in grads.items():
        np.testing.assert_allclose(g, P[name].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_float32_model_agrees_with_float64(config, batch):
    tokens, targets = batch
    m64 = make_model(**config)
    m32 = make_model(**config, dtype=np.float32)
    m32.params = {name: p.astype(np.float32) for name, p in m64.params.items()}
    loss64, grads64 = m64.loss_and_grads(tokens, targets)
    loss32, grads32 = m32.loss_and_grads(tokens, targets)
    assert m32.forward(tokens).dtype == np.float32
    assert loss32 == pytest.approx(loss64, rel=1e-5)
    for name, g in grads32.items():
        assert g.dtype == np.float32, name
        np.testing.assert_allclose(g, grads64[name], rtol=1e-3, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Generation and the forward probes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_k=4)])
def test_generation_with_and_without_cache_agree(config, sampling, rng):
    model = make_model(**config)
    prompt = rng.integers(0, V, size=(3, 2))
    runs = [
        model.generate(prompt, 4, rng=np.random.default_rng(5), use_cache=use_cache, **sampling)
        for use_cache in (True, False)
    ]
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_cached_logits_equal_the_full_forward(config, rng):
    """Stronger than equal tokens: the logits of the cached path, prompt then token by token,
    are the full forward's."""
    model = make_model(**config)
    tokens = rng.integers(0, V, size=(2, MAX_LEN))
    full = model.forward(tokens)
    cache = model._new_cache(2, MAX_LEN)
    prefill = model._forward_cached(tokens[:, :3], cache, 0)
    steps = [model._forward_cached(tokens[:, t : t + 1], cache, t) for t in range(3, MAX_LEN)]
    np.testing.assert_allclose(
        np.concatenate([prefill, *steps], axis=1), full, rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_probes_work_with_the_options(config):
    """kv_transform (the identity changes nothing; zero values remove the attention, like a
    zero w_o) and attn_mask (everything allowed is the causal model)."""
    model, tokens = make_model(**config), np.array([[1, 4, 2, 6, 0]])
    plain = model.forward(tokens)
    np.testing.assert_array_equal(model.forward(tokens, kv_transform=lambda i, k, v: (k, v)), plain)
    np.testing.assert_allclose(
        model.forward(tokens, attn_mask=np.ones((5, 5), dtype=bool)), plain, rtol=1e-12, atol=1e-12
    )
    zeroed = model.forward(tokens, kv_transform=lambda i, k, v: (k, np.zeros_like(v)))
    for i in range(model.n_layers):
        model.params[f"blocks.{i}.attn.w_o"][:] = 0
    np.testing.assert_allclose(zeroed, model.forward(tokens), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_attn_mask_restricts_the_attention_with_the_options(config):
    """Each token attending to itself only: the weights are diagonal (times one minus the
    sink's weight with a sink), and the earlier tokens no longer matter."""
    model, tokens = make_model(**config), np.array([[1, 4, 2, 6, 0]])
    self_only = np.eye(5, dtype=bool)
    logits, weights = model.forward(tokens, attn_mask=self_only, return_attention=True)
    for w in weights:
        np.testing.assert_array_equal(w * ~self_only, 0.0)
        diagonal = np.diagonal(w, axis1=-2, axis2=-1)
        if config.get("sink"):
            assert np.all((0 < diagonal) & (diagonal < 1))
        else:
            np.testing.assert_allclose(diagonal, 1.0, rtol=1e-15)
    other = model.forward(np.array([[3, 3, 3, 6, 0]]), attn_mask=self_only)
    np.testing.assert_allclose(other[0, 3:], logits[0, 3:], rtol=1e-13, atol=1e-14)


def test_float32_generation_with_every_option(rng):
    model = make_model(**CONFIGS["everything-gqa-rope-rms"], dtype=np.float32)
    prompt = rng.integers(0, V, size=(3, 2))
    cached = model.generate(prompt, 4, temperature=0)
    np.testing.assert_array_equal(cached, model.generate(prompt, 4, temperature=0, use_cache=False))
    cache = model._new_cache(3, MAX_LEN)
    assert model._forward_cached(prompt, cache, 0).dtype == np.float32


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_causal_with_the_options(config, rng):
    model = make_model(**config)
    a = rng.integers(0, V, size=6)
    b = a.copy()
    b[4:] = (b[4:] + 1) % V
    np.testing.assert_allclose(model.forward(a)[:4], model.forward(b)[:4], rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# The defaults: the plain model, unchanged
# ---------------------------------------------------------------------------------------------


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for name, a in arrays.items():
        h.update(name.encode() + np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def plain_model(**options):
    return nn.DecoderLM(
        vocab_size=V,
        d_model=E,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_ff=12,
        max_len=MAX_LEN,
        rng=np.random.default_rng(0),
        **options,
    )


# Computed with the model as it was before the options existed (sdpa of 2026-11-27).
PLAIN_PARAMS_DIGEST = "a8f44f501d78d49d"
PLAIN_LOGITS = [  # the first three logits at each position of the tokens [1, 4, 2, 6, 0]
    [1.2904417150281606, 0.06949056158122655, -0.43199051776721714],
    [-0.1524898379210993, 0.5026285959005404, -0.597879216042584],
    [0.9023904385821571, 0.29035912946681847, -0.8689751163489894],
    [-0.455889172717714, -1.7758801085101614, -0.9563991431786935],
    [-0.17827420022281248, 0.26850189833177834, -1.158430715212617],
]
OFF = dict(qk_norm=False, logit_softcap=None, attn_softcap=None, sink=False, output_gate=False)


def test_defaults_leave_the_plain_model_unchanged():
    """The options off (by default or explicitly) give the parameters of the model before the
    options, bit for bit, and its logits (to rounding, which BLAS may change across machines)."""
    tokens = np.array([[1, 4, 2, 6, 0]])
    default, off = plain_model(), plain_model(**OFF)
    assert digest(default.params) == digest(off.params) == PLAIN_PARAMS_DIGEST
    np.testing.assert_array_equal(off.forward(tokens), default.forward(tokens))
    np.testing.assert_allclose(default.forward(tokens)[0, :, :3], PLAIN_LOGITS, rtol=1e-13)
    assert repr(off) == repr(default) and repr(default).endswith("dtype=float64)")


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_options_only_add_parameters(config):
    """A model with options starts from the plain model's values of the shared parameters (the
    options' random parameters are drawn last), so the two compare like for like."""
    with_options = make_model(**config, perturb=False)
    plain = make_model(**{k: v for k, v in config.items() if k not in OFF}, perturb=False)
    assert [n for n in with_options.params if not is_new(n)] == list(plain.params)
    for name, p in plain.params.items():
        np.testing.assert_array_equal(with_options.params[name], p, err_msg=name)
    assert repr(with_options).endswith(
        "".join(f", {k}={config[k]!r}" for k in OFF if k in config) + ")"
    )


# ---------------------------------------------------------------------------------------------
# QK-norm
# ---------------------------------------------------------------------------------------------


def test_qk_norm_parameters():
    model = make_model(qk_norm=True, n_heads=4, n_kv_heads=2)  # Dk = 2
    fresh = make_model(qk_norm=True, n_heads=4, perturb=False)
    for i in range(2):
        for which in ("q", "k"):
            assert model.params[f"blocks.{i}.attn.{which}_norm.weight"].shape == (2,)
            np.testing.assert_array_equal(fresh.params[f"blocks.{i}.attn.{which}_norm.weight"], 1)


def test_qk_norm_queries_and_keys_have_the_rms_of_the_gain(rng):
    """With a constant gain g, every query and key of every head has root mean square |g| over
    Dk (to eps = 1e-6), whatever the projections' scale; RoPE, a rotation, keeps it."""
    model = make_model(qk_norm=True, n_heads=2)
    for name in ("w_q", "w_k"):
        model.params["blocks.0.attn." + name] *= 1000.0  # huge projections: normalised anyway
    model.params["blocks.0.attn.q_norm.weight"][:] = 1.5
    model.params["blocks.0.attn.k_norm.weight"][:] = -0.25
    h = rng.standard_normal((2, 5, E))
    q, k, _ = model._qkv(0, h, 0)
    np.testing.assert_allclose(np.sqrt(np.mean(q**2, axis=-1)), 1.5, rtol=1e-10)
    np.testing.assert_allclose(np.sqrt(np.mean(k**2, axis=-1)), 0.25, rtol=1e-10)
    seen = {}

    def record(i, k, v):
        seen[i] = k
        return k, v

    model.forward(rng.integers(0, V, size=(2, 5)), kv_transform=record)
    np.testing.assert_allclose(np.sqrt(np.mean(seen[0] ** 2, axis=-1)), 0.25, rtol=1e-10)


def test_qk_norm_bounds_the_scores(rng):
    """|q . k| / sqrt(Dk) <= Dk |g_q| |g_k| / sqrt(Dk) = sqrt(Dk) |g_q| |g_k| for constant
    gains, however large the projections: a score cannot blow up (the point of QK-norm)."""
    model = make_model(qk_norm=True, attention_only=True, n_heads=2)  # Dk = 4
    for name in ("w_q", "w_k"):
        model.params["blocks.0.attn." + name] *= 1e6
    model.params["blocks.0.attn.q_norm.weight"][:] = 2.0
    model.params["blocks.0.attn.k_norm.weight"][:] = 3.0
    q, k, _ = model._qkv(0, rng.standard_normal((1, 5, E)), 0)
    scores = q @ k.swapaxes(-1, -2) / 2.0  # sqrt(Dk) = 2
    assert np.abs(scores).max() <= 2.0 * 2.0 * 3.0 * (1 + 1e-12)


# ---------------------------------------------------------------------------------------------
# Logit soft-cap
# ---------------------------------------------------------------------------------------------


def test_logit_softcap_caps_the_plain_logits(rng):
    """The capped model's logits are cap * tanh(plain logits / cap): all in (-cap, cap), and
    the same next-token ranking (tanh is increasing)."""
    tokens = rng.integers(0, V, size=(2, 5))
    plain = make_model().forward(tokens)
    capped = make_model(logit_softcap=0.5).forward(tokens)
    np.testing.assert_allclose(capped, 0.5 * np.tanh(plain / 0.5), rtol=1e-14, atol=1e-15)
    assert np.abs(plain).max() > 1.0 and np.abs(capped).max() < 0.5
    np.testing.assert_array_equal(np.argmax(capped, -1), np.argmax(plain, -1))


def test_a_huge_logit_softcap_changes_nothing(batch):
    """cap * tanh(x / cap) = x - x^3 / (3 cap^2) + ...: with cap = 1e6 and |x| < 10 the change
    is below 1e-10, and so is the gradients'."""
    tokens, targets = batch
    loss, grads = make_model().loss_and_grads(tokens, targets)
    loss_c, grads_c = make_model(logit_softcap=1e6).loss_and_grads(tokens, targets)
    assert loss_c == pytest.approx(loss, rel=1e-10)
    for name, g in grads.items():
        np.testing.assert_allclose(grads_c[name], g, rtol=1e-8, atol=1e-12, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Attention soft-cap
# ---------------------------------------------------------------------------------------------


def test_attn_softcap_weights_by_hand(rng):
    """One attention-only block: the model's weights are the softmax, over the causal keys, of
    cap * tanh(q . k / sqrt(Dk) / cap), with q and k the block's queries and keys."""
    model = make_model(attn_softcap=0.6, attention_only=True, n_layers=1, n_heads=2)
    tokens = rng.integers(0, V, size=5)
    _, (weights,) = model.forward(tokens, return_attention=True)  # (H, T, T)
    h = nn.layer_norm(
        model.params["token_embedding"][tokens],
        model.params["blocks.0.attn_norm.weight"],
        model.params["blocks.0.attn_norm.bias"],
        eps=1e-5,
    )
    q, k, _ = model._qkv(0, h[None], 0)  # (1, H, T, Dk), after RoPE
    z = 0.6 * np.tanh(q[0] @ k[0].swapaxes(-1, -2) / 2.0 / 0.6)  # (H, T, T); sqrt(Dk) = 2
    assert np.abs(q[0] @ k[0].swapaxes(-1, -2) / 2.0).max() > 1.0  # the cap is reached
    z = np.where(np.tril(np.ones((5, 5), dtype=bool)), z, -np.inf)
    expected = np.exp(z - z.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, expected, rtol=1e-13, atol=1e-15)


def test_a_tiny_attn_softcap_gives_uniform_causal_attention(rng):
    """Every score within +-1e-9: each query spreads its attention evenly over its t + 1 keys."""
    model = make_model(attn_softcap=1e-9)
    _, attention = model.forward(rng.integers(0, V, size=(2, 5)), return_attention=True)
    uniform = np.tril(np.ones((5, 5))) / np.arange(1, 6)[:, None]
    for w in attention:
        np.testing.assert_allclose(w, np.broadcast_to(uniform, w.shape), rtol=1e-8, atol=1e-15)


@pytest.mark.parametrize("config", [{}, dict(n_heads=4, n_kv_heads=1)], ids=["mha", "mqa"])
def test_a_huge_attn_softcap_is_the_plain_model(config, batch):
    """cap = 1e7: the written-out path (its forward, backward and weights) equals the plain
    sdpa path to rounding, GQA's grouping of heads included."""
    tokens, targets = batch
    plain, capped = make_model(**config), make_model(attn_softcap=1e7, **config)
    loss, grads = plain.loss_and_grads(tokens, targets)
    loss_c, grads_c = capped.loss_and_grads(tokens, targets)
    assert loss_c == pytest.approx(loss, rel=1e-12)
    for name, g in grads.items():
        np.testing.assert_allclose(grads_c[name], g, rtol=1e-9, atol=1e-12, err_msg=name)
    for w, w_c in zip(plain.forward(tokens, return_attention=True)[1],
                      capped.forward(tokens, return_attention=True)[1]):  # fmt: skip
        np.testing.assert_allclose(w_c, w, rtol=1e-12, atol=1e-14)


def softcapped_case(rng, B=2, Hq=6, Hkv=2, T=3, S=5, Dk=4):
    """Inputs of the written-out attention: grouped heads, T != S, a mask that keeps one key
    per row at least, sinks of shape (Hq, 1)."""
    allowed = rng.random((T, S)) < 0.6
    allowed[np.arange(T), np.arange(T) + S - T] = True
    return dict(
        q=2.0 * rng.standard_normal((B, Hq, T, Dk)),
        k=2.0 * rng.standard_normal((B, Hkv, S, Dk)),
        v=rng.standard_normal((B, Hkv, S, Dk)),
        allowed=allowed,
        sinks=rng.standard_normal((Hq, 1)),
        d_out=rng.standard_normal((B, Hq, T, Dk)),
    )


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_softcapped_attention_matches_torch(torch, rng, with_sinks):
    """The written-out attention and its backward against torch.autograd on the formula, for
    grouped heads, a mask with T != S and (optionally) sinks."""
    from sdpa.nn.softcap import softcapped_attention, softcapped_attention_backward

    c, cap = softcapped_case(rng), 1.3
    sinks = c["sinks"] if with_sinks else None
    out, weights, lse = softcapped_attention(c["q"], c["k"], c["v"], cap, c["allowed"], sinks)
    d_q, d_k, d_v, d_sinks = softcapped_attention_backward(
        c["d_out"], c["q"], c["k"], c["v"], cap, weights, lse, sinks
    )
    t = {name: torch.tensor(c[name], requires_grad=True) for name in ("q", "k", "v", "sinks")}
    k, v = (t[n].repeat_interleave(3, dim=1) for n in ("k", "v"))
    z = t["q"] @ k.transpose(-1, -2) / 2.0
    z = (cap * torch.tanh(z / cap)).masked_fill(~torch.from_numpy(c["allowed"]), -torch.inf)
    if with_sinks:
        z = torch.cat([z, t["sinks"].reshape(1, 6, 1, 1).expand(2, 6, 3, 1)], dim=-1)
    t_weights = torch.softmax(z, dim=-1)[..., :5]
    t_out = t_weights @ v
    (t_out * torch.tensor(c["d_out"])).sum().backward()
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(weights, t_weights.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, torch.logsumexp(z, dim=-1).detach().numpy(), rtol=1e-13)
    for name, ours in (("q", d_q), ("k", d_k), ("v", d_v)):
        np.testing.assert_allclose(ours, t[name].grad.numpy(), rtol=1e-10, atol=1e-13)
    if with_sinks:
        np.testing.assert_allclose(d_sinks.sum(axis=(0, 2))[:, None], t["sinks"].grad.numpy())
    else:
        assert d_sinks is None


# ---------------------------------------------------------------------------------------------
# Sink
# ---------------------------------------------------------------------------------------------


def with_sinks(model, value):
    for i in range(model.n_layers):
        model.params[f"blocks.{i}.attn.sink"][:] = value
    return model


@pytest.mark.parametrize("cap", [None, 0.9], ids=["sdpa", "attn_softcap"])
def test_a_very_negative_sink_is_the_model_without_sink(cap, batch):
    """exp(-1000) = 0: the sink's column vanishes, and the model, its weights and its
    gradients (the sink's own is 0) are those of the model without a sink."""
    tokens, targets = batch
    plain = make_model(n_heads=4, n_kv_heads=2, attn_softcap=cap)
    sunk = with_sinks(make_model(sink=True, n_heads=4, n_kv_heads=2, attn_softcap=cap), -1000.0)
    logits, weights = sunk.forward(tokens, return_attention=True)
    plain_logits, plain_weights = plain.forward(tokens, return_attention=True)
    np.testing.assert_allclose(logits, plain_logits, rtol=1e-13, atol=1e-14)
    for w, pw in zip(weights, plain_weights):
        np.testing.assert_allclose(w, pw, rtol=1e-13, atol=1e-15)
    loss, grads = sunk.loss_and_grads(tokens, targets)
    plain_loss, plain_grads = plain.loss_and_grads(tokens, targets)
    assert loss == pytest.approx(plain_loss, rel=1e-14)
    for name, g in grads.items():
        expected = plain_grads.get(name, np.zeros_like(g))
        np.testing.assert_allclose(g, expected, rtol=1e-11, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("cap", [None, 0.9], ids=["sdpa", "attn_softcap"])
def test_a_huge_sink_silences_the_attention(cap, rng):
    """A sink logit of 1000 takes all the mass: every attention output is 0 (the weights sum
    to exp(z - 1000) ~ 0), so the model is the one whose w_o are zero."""
    tokens = rng.integers(0, V, size=(2, 5))
    model = with_sinks(make_model(sink=True, attn_softcap=cap), 1000.0)
    _, weights = model.forward(tokens, return_attention=True)
    assert all(np.all(w < 1e-300) for w in weights)
    silenced = copy.deepcopy(model)
    for i in range(model.n_layers):
        silenced.params[f"blocks.{i}.attn.w_o"][:] = 0.0
    np.testing.assert_array_equal(model.forward(tokens), silenced.forward(tokens))


def test_sink_zero_is_softmax_plus_one(rng):
    """A zero sink logit (the initial value) adds exp(0) = 1 to each denominator: the weights
    are the no-sink weights times sum_j exp(z_ij) / (sum_j exp(z_ij) + 1), checked on one
    attention-only block (scores from the block's own queries and keys)."""
    plain = make_model(attention_only=True, n_layers=1, n_heads=2)
    sunk = with_sinks(make_model(sink=True, attention_only=True, n_layers=1, n_heads=2), 0.0)
    tokens = rng.integers(0, V, size=5)
    (w_plain,) = plain.forward(tokens, return_attention=True)[1]
    (w_sink,) = sunk.forward(tokens, return_attention=True)[1]
    h = nn.layer_norm(
        plain.params["token_embedding"][tokens],
        plain.params["blocks.0.attn_norm.weight"],
        plain.params["blocks.0.attn_norm.bias"],
        eps=1e-5,
    )
    q, k, _ = plain._qkv(0, h[None], 0)
    z = np.where(np.tril(np.ones((5, 5), bool)), q[0] @ k[0].swapaxes(-1, -2) / 2.0, -np.inf)
    total = np.exp(z).sum(-1, keepdims=True)  # (H, T, 1)
    np.testing.assert_allclose(w_sink, w_plain * total / (total + 1.0), rtol=1e-13)
    np.testing.assert_allclose(w_sink.sum(-1), 1.0 - 1.0 / (total[..., 0] + 1.0), rtol=1e-13)


def test_sink_parameters():
    model = make_model(sink=True, n_heads=4, n_kv_heads=2, perturb=False)
    for i in range(2):
        np.testing.assert_array_equal(model.params[f"blocks.{i}.attn.sink"], np.zeros(4))


# ---------------------------------------------------------------------------------------------
# Output gate
# ---------------------------------------------------------------------------------------------


def test_a_zero_gate_matrix_halves_the_heads(rng):
    """W_g = 0: sigmoid(0) = 1/2 on every head's output, so the gated model is the plain model
    with w_o halved (the other parameters shared)."""
    gated = make_model(output_gate=True, n_heads=4, n_kv_heads=2)
    halved = make_model(n_heads=4, n_kv_heads=2)
    for i in range(2):
        gated.params[f"blocks.{i}.attn.w_g"][:] = 0.0
        halved.params[f"blocks.{i}.attn.w_o"] *= 0.5
    tokens = rng.integers(0, V, size=(2, 5))
    np.testing.assert_allclose(gated.forward(tokens), halved.forward(tokens), rtol=1e-13)
    assert np.array_equal(gated._gate(0, rng.standard_normal((2, 5, E))), np.full((2, 5, E), 0.5))


def test_the_gate_by_hand(rng):
    """One attention-only block: x = x0 + (heads * sigmoid(h W_g)) W_o, with the heads
    A_h (h W_v)_h from the model's own weights."""
    model = make_model(
        output_gate=True, attention_only=True, n_layers=1, positional="learned", norm="rms"
    )
    P, Dk = model.params, model.head_dim
    tokens = rng.integers(0, V, size=5)
    logits, (A,) = model.forward(tokens, return_attention=True)  # (H, T, T)

    def rms(x, w):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * w

    x0 = P["token_embedding"][tokens] + P["position_embedding"][:5]
    h = rms(x0, P["blocks.0.attn_norm.weight"])
    v = h @ P["blocks.0.attn.w_v"]  # (T, H Dk)
    heads = np.concatenate([A[j] @ v[:, j * Dk : (j + 1) * Dk] for j in range(2)], axis=-1)
    gate = 1.0 / (1.0 + np.exp(-(h @ P["blocks.0.attn.w_g"])))
    assert 0 < gate.min() and gate.max() < 1 and gate.std() > 0.1  # a gate that varies
    x = x0 + (heads * gate) @ P["blocks.0.attn.w_o"]
    np.testing.assert_allclose(logits, rms(x, P["final_norm.weight"]) @ P["unembedding"], 1e-12)


def test_the_gate_is_a_sigmoid_without_overflow():
    """Logits of +-1000 give gates 1 and 0 exactly, without overflow (exp(-1000) underflows
    to 0, harmlessly)."""
    model = make_model(output_gate=True, n_layers=1)
    model.params["blocks.0.attn.w_g"][:] = 0.0
    model.params["blocks.0.attn.w_g"][0, :4] = 1000.0
    model.params["blocks.0.attn.w_g"][0, 4:] = -1000.0
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        gate = model._gate(0, np.ones((1, 2, E)))
    np.testing.assert_array_equal(gate, [[[1.0] * 4 + [0.0] * 4] * 2])


# ---------------------------------------------------------------------------------------------
# Errors: one test per raise
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["qk_norm", "sink", "output_gate"])
def test_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=f"{flag} must be a bool; got 1"):
        make_model(**{flag: 1})


@pytest.mark.parametrize("cap", ["logit_softcap", "attn_softcap"])
@pytest.mark.parametrize("value", ["30", True, 1j])
def test_caps_must_be_real_numbers(cap, value):
    with pytest.raises(
        TypeError, match=f"{cap} must be None or a positive, finite real number; got"
    ):
        make_model(**{cap: value})


@pytest.mark.parametrize("cap", ["logit_softcap", "attn_softcap"])
@pytest.mark.parametrize("value", [0, -30.0, np.inf, np.nan])
def test_caps_must_be_positive_and_finite(cap, value):
    with pytest.raises(
        ValueError, match=rf"{cap} must be None or a positive, finite real number; got {value!r}"
    ):
        make_model(**{cap: value})
