"""``python -m sdpa``: five short demonstrations that print shapes and rounded matrices."""

from __future__ import annotations

import argparse

import numpy as np

from .attention import scaled_dot_product_attention
from .examples import the_cat_sleeps
from .masks import causal_mask, padding_mask
from .multihead import MultiHeadAttention
from .positional import sinusoidal_positional_encoding


def _matrix(a: np.ndarray, rows=None, cols=None, digits: int = 3) -> str:
    """Format a 2-D array with optional row and column labels."""
    a = np.round(np.asarray(a, dtype=float), digits) + 0.0  # + 0.0 turns -0.0 into 0.0
    cols = cols or [str(j) for j in range(a.shape[1])]
    rows = rows or [str(i) for i in range(a.shape[0])]
    width = max(digits + 4, *(len(c) for c in cols))
    pad = max(len(r) for r in rows)
    lines = [" " * pad + " " + " ".join(c.rjust(width) for c in cols)]
    for r, row in zip(rows, a):
        lines.append(r.rjust(pad) + " " + " ".join(f"{x:{width}.{digits}f}" for x in row))
    return "\n".join(lines)


def demo_simple(rng: np.random.Generator) -> None:
    print("1. Simple attention: 3 queries, 3 keys, Dk = Dv = 4")
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    print(f"   query {q.shape}, key {k.shape}, value {v.shape} -> out {out.shape}")
    print("   weights (each row sums to 1):")
    print(_matrix(w))


def demo_causal(rng: np.random.Generator) -> None:
    print("2. Causal attention: token i sees tokens 0..i")
    q, k, v = (rng.standard_normal((4, 4)) for _ in range(3))
    _, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    print("   mask (1 = may attend):")
    print(_matrix(causal_mask(4), digits=0))
    print("   weights (zero above the diagonal):")
    print(_matrix(w))


def demo_batched(rng: np.random.Generator) -> None:
    print("3. Batched attention: B = 2 sequences with different padding")
    q, k, v = (rng.standard_normal((2, 5, 8)) for _ in range(3))  # (B, T, D)
    lengths = np.array([5, 3])
    mask = padding_mask(lengths, 5)[:, 0]  # (B, 1, 1, S) -> (B, 1, S) for 3-D inputs
    out, w = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    print(f"   query {q.shape} -> out {out.shape}, weights {w.shape}")
    print("   weights of sequence 1 (length 3: keys 3 and 4 are padding):")
    print(_matrix(w[1]))


def demo_multihead(rng: np.random.Generator) -> None:
    print("4. Multi-head attention: E = 16, Hq = 4 query heads sharing Hkv = 2 key/value heads")
    mha = MultiHeadAttention.random(16, 4, n_kv_heads=2, rng=rng)
    x = rng.standard_normal((1, 6, 16))
    out, w = mha(x, is_causal=True, return_weights=True)
    # the book's letters (E, Hq, Hkv, Dk, Dv), not the constructor's argument names
    print(
        f"   W_q {mha.W_q.shape}, W_k {mha.W_k.shape}, W_v {mha.W_v.shape}, W_o {mha.W_o.shape}: "
        f"E = {mha.d_model}, Dk = {mha.head_dim}, Dv = {mha.value_dim}"
    )
    print(f"   x {x.shape} -> out {out.shape}, per-head weights {w.shape}")
    print("   head 0, last token's weights:", np.round(w[0, 0, -1], 3))


def demo_sentence() -> None:
    print('5. A sentence: "The cat sleeps." (the walk-through uses unscaled scores, scale=1)')
    ex = the_cat_sleeps()
    out, w = scaled_dot_product_attention(ex.Q, ex.K, ex.V, scale=1.0, return_weights=True)
    print(_matrix(w, rows=list(ex.tokens), cols=list(ex.tokens)))
    print('   output for "cat":', np.round(out[1], 3))
    pe = sinusoidal_positional_encoding(len(ex.tokens), 4)
    print("   sinusoidal positions (T=3, d=4):")
    print(_matrix(pe, rows=list(ex.tokens)))


def main(argv: list[str] | None = None) -> int:
    """Run the five demonstrations and return the exit status 0.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (default: ``sys.argv[1:]``); ``--seed N`` changes the random
        inputs of the first four demonstrations.

    Returns
    -------
    int
        0, the exit status.

    Examples
    --------
    >>> from sdpa.__main__ import main
    >>> main(["--seed", "0"])
    1. Simple attention: 3 queries, 3 keys, Dk = Dv = 4
    ...
    5. A sentence: "The cat sleeps." (the walk-through uses unscaled scores, scale=1)
    ...
       output for "cat": [0.788 1.576]
    ...
    0
    """
    parser = argparse.ArgumentParser(
        prog="python -m sdpa", description="Short demonstrations of scaled dot-product attention."
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    for demo in (demo_simple, demo_causal, demo_batched, demo_multihead):
        demo(rng)
        print()
    demo_sentence()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
