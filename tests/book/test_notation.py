"""One notation in every page: the collisions the notation appendix rules out do not occur.

``book/appendix/notation.md`` is the single source of the book's symbols. This test reads the
maths (``$...$`` and ``$$...$$``) and the code cells of every page and fails on the collisions
that used to occur: ``S`` as a matrix or a state (it is only the key length), ``d_k``/``d_v``
for the head widths in maths (they are ``D_k``, ``D_v``), ``\\ell`` for the log-sum-exp (it is
only the online softmax's running normaliser; the log-sum-exp is ``\\operatorname{lse}``), the
weights as ``P``, ``p_{ij}`` or ``w_{ij}`` (they are ``A``, ``a_{ij}``), the backward's row term
as ``D_i`` (it is ``\\delta_i``), a Kronecker delta ``\\delta_{jl}`` (it is
``\\mathbb{1}_{j=l}``), the sinusoidal frequencies as ``\\omega_i`` (they are RoPE's
``\\theta_c``), ``N`` for anything (FlashAttention's name for our ``n``), and, in code, a
gradient or a width named ``d_k``/``d_v``.

A paragraph that quotes another work's notation on purpose (to translate it) is preceded by a
MyST comment line ``% notation: quoting <work>``; the check skips that paragraph.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
SOURCES = sorted(
    p for p in BOOK.rglob("*.md") if "_static" not in p.parts and "_templates" not in p.parts
)

MATH_RULES = [
    (
        re.compile(
            r"(?<![\w\\])S\s*=\s*Q|(?<![\w\\])S_\{?[ij0-9]|\\mathbf\{S\}|(?<![\w\\])dS\b|(?<![\w\\])S\^\{?\\top"
        ),
        "S is the key length only; the scores are Z (z_ij), a state is U_i",
    ),
    (
        re.compile(r"(?<![\w\\])d_\{?[kv]\b|d_\{?\\(?:text|mathrm)\{model\}"),
        "head widths are D_k and D_v (the model width is E)",
    ),
    (
        re.compile(r"\\ell(?:_\{?\w+\}?)?\s*=\s*\\log"),
        "the log-sum-exp is \\operatorname{lse}; \\ell is the online softmax's running normaliser",
    ),
    (
        re.compile(
            r"(?<![\w\\])[Pp]_\{?ij\b|(?<![\w\\])w_\{?ij\b|(?<![\w\\])P\s*=\s*\\operatorname\{softmax\}"
        ),
        "the weights are A, with entries a_ij",
    ),
    (
        re.compile(r"(?<![\w\\])D_\{?i\}?(?![\w])"),
        "the backward's row term is \\delta_i (D_i is another work's name)",
    ),
    (
        re.compile(r"\\delta_\{\s*[a-z]\s*,?\s*[a-z]\s*\}"),
        "the Kronecker delta is written \\mathbb{1}_{j=l} (\\delta_i is the backward's row term)",
    ),
    (
        re.compile(r"\\omega_"),
        "the sinusoidal table's and RoPE's frequencies are \\theta_c, for the pair of features c",
    ),
    (
        re.compile(r"(?<![\w\\{])N(?![\w])"),
        "N is FlashAttention's name for the sequence length n; blocks and tokens are counted "
        "by other letters",
    ),
]
CODE_RULE = (
    re.compile(r"(?<![\w.'\"])d_[kv]\b(?!['\"])"),
    "code names gradients dq, dk, dv and widths Dk, Dv; d_k / d_v are neither",
)


def _paragraphs(text: str):
    """Paragraphs of prose (code cells removed), each with whether it is exempt."""
    text = re.sub(r"^```\{code-cell\}.*?^```\s*$", "", text, flags=re.M | re.S)
    exempt_next = False
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        if not lines:
            continue
        if lines[0].startswith("% notation: quoting"):
            exempt_next = True
            if len(lines) == 1:
                continue
            yield "\n".join(lines[1:]), True
            exempt_next = False
            continue
        yield block, exempt_next
        exempt_next = False


def _maths(paragraph: str) -> list[str]:
    spans = re.findall(r"\$\$(.+?)\$\$", paragraph, re.S)
    rest = re.sub(r"\$\$.+?\$\$", "", paragraph, flags=re.S)
    spans += re.findall(r"(?<!\\)\$([^$\n]+?)(?<!\\)\$", rest)
    spans += re.findall(r"\{math\}`([^`]+)`", paragraph)
    return spans


def math_problems(text: str) -> list[str]:
    problems = []
    for paragraph, exempt in _paragraphs(text):
        if exempt:
            continue
        for span in _maths(paragraph):
            for pattern, why in MATH_RULES:
                hit = pattern.search(span)
                if hit:
                    problems.append(f"${span.strip()[:70]}$: {why}")
    return problems


def code_problems(text: str) -> list[str]:
    problems = []
    for match in re.finditer(r"^```\{code-cell\}[^\n]*\n(.*?)^```\s*$", text, re.M | re.S):
        for line in match.group(1).splitlines():
            code = line.split("#")[0]
            if CODE_RULE[0].search(code):
                problems.append(f"{line.strip()[:70]!r}: {CODE_RULE[1]}")
    return problems


def _pages() -> list:
    pages = [path.relative_to(BOOK).as_posix() for path in SOURCES]
    return [pytest.param(page, id=page) for page in pages]


@pytest.mark.parametrize("page", _pages())
def test_page_follows_the_notation(page):
    text = (BOOK / page).read_text(encoding="utf-8")
    problems = math_problems(text) + code_problems(text)
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(
    ("maths", "expect"),
    [
        (r"$S = QK^\top$", "key length only"),
        (r"$S_{ij}$", "key length only"),
        (r"$U_i = U_{i-1} + \phi(k_i) v_i^\top$ and $S_i$", "key length only"),
        (r"$\sqrt{d_k}$", "D_k and D_v"),
        (r"$\ell_i = \log \sum_j e^{z_{ij}}$", "operatorname{lse}"),
        (r"$P = \operatorname{softmax}(Z)$", "entries a_ij"),
        (r"$w_{ij}$", "entries a_ij"),
        (r"$D_i = do_i \cdot o_i$", "delta_i"),
        (r"$a_j (\delta_{jl} - a_l)$", "Kronecker delta"),
        (r"$\sin(\omega_i t)$", "theta_c"),
        (r"$O(N^3)$", "FlashAttention's name"),
        (r"$X^{(N)}$", "FlashAttention's name"),
    ],
)
def test_the_rules_catch_each_collision(maths, expect):
    problems = math_problems(f"Text {maths} text.")
    assert len(problems) == 1 and expect in problems[0], problems


@pytest.mark.parametrize(
    "maths",
    [
        r"$(T, S)$",
        r"$S = T$",
        r"$1/\sqrt{D_k}$",
        r"$\ell_i$ and $m_i$",
        r"$a_{ij}$",
        r"$D_k$, $D_v$",
        r"$\operatorname{lse}_i = \log \sum_j e^{z_{ij}}$",
        r"$\delta_i$",
        r"$\delta_{i}$",
        r"$a_j (\mathbb{1}_{j=l} - a_l)$",
        r"$\sin(\theta_c t)$",
        r"$Z = QK^\top/\sqrt{D_k}$",
        r"$O(n^3)$",
        r"$x \in \mathbb{N}$",
    ],
)
def test_the_rules_accept_the_book_notation(maths):
    assert math_problems(f"Text {maths} text.") == []


def test_a_quoting_paragraph_is_exempt():
    text = "% notation: quoting FlashAttention-2\nThe paper writes $S = QK^\\top$ and $D_i$.\n"
    assert math_problems(text) == []
    assert math_problems("The paper writes $S = QK^\\top$.") != []


def test_code_rule():
    cell = "```{code-cell} ipython3\n%s\n```\n"
    assert code_problems(cell % "d_k = 64") != []
    assert code_problems(cell % "dq, d_k, dv = grads") != []
    assert code_problems(cell % "dq, dk, dv = grads  # not d_k") == []
    assert code_problems(cell % "Dk = q.shape[-1]") == []
