"""The book's diagrams (sdpa_book.diagrams), all together: each stays legible (fonts of at least
MIN_FONT_PT, no text clipped or overlapping other text, at most FULL_WIDTH wide) at
representative and extreme sizes, and the package exports the names the API page documents.

Each module of the package has its own file, ``test_<module>.py`` beside this one (each diagram's
shapes, proportions and errors); the helpers they share are in ``diagram_checks.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from diagram_checks import assert_legible, assert_reads_on_a_phone, build, smallest_text_px  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402

LEGIBLE = [
    ("attention_pipeline_diagram", (3, 5, 7, 2), {}),
    ("attention_pipeline_diagram", (3, 5, 7, 2), {"compact": True}),
    ("attention_pipeline_diagram", (1, 7, 1, 1), {}),
    ("attention_pipeline_diagram", (1024, 1024, 64, 64), {}),
    ("attention_pipeline_diagram", (1024, 1024, 64, 64), {"compact": True}),
    ("multihead_diagram", (5, 11, 3, 2, 7), {}),
    ("multihead_diagram", (2, 512, 8, 64, 64), {}),
    ("grouped_heads_diagram", (8, (8, 2, 1)), {}),
    ("grouped_heads_diagram", (6, (6, 3, 2, 1)), {}),
    ("grouped_heads_diagram", (32, (32, 8, 1)), {}),
    ("mask_geometry_diagram", (6, 6), {"window": 3, "lengths": (4, 6)}),
    ("mask_geometry_diagram", (3, 7), {"window": 2, "lengths": (5,)}),
    ("mask_geometry_diagram", (5, 3), {}),
    ("kv_cache_diagram", (5, 3), {}),
    ("kv_cache_diagram", (1, 1), {}),
    ("kv_cache_diagram", (20, 12), {}),
    ("flash_loop_diagram", (6, 10, 2, 5, 3, 7), {}),
    ("flash_loop_diagram", (1024, 1024, 128, 128, 64, 64), {}),
    ("backward_graph_diagram", (), {"T": 3, "S": 5, "Dk": 7, "Dv": 2}),
    ("backward_graph_diagram", (), {}),
    ("transformer_block_diagram", (), {"norm": "pre", "T": 5, "E": 16}),
    ("transformer_block_diagram", (), {"norm": "post", "T": 1024, "E": 4096}),
]


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    LEGIBLE,
    ids=[f"{n.removesuffix('_diagram')}{a}{k or ''}" for n, a, k in LEGIBLE],
)
def test_diagram_is_legible(name, args, kwargs):
    assert_legible(build(name, *args, **kwargs))


# Diagrams redrawn for a phone, at the sizes of the book's pages and at extremes.
PAGE_TOKEN = (  # what-attention-does: "it", its seven components and the three projections
    (0, 0, 0, 1, 0, 1, 0),
    tuple(
        tuple(2 * (k == 5) * (j < 2) + 2 * (k == 6) * (j in (0, 2)) for j in range(5))
        for k in range(7)
    ),
    tuple(tuple(int(k == j) for j in range(5)) for k in range(7)),
    tuple(tuple(int(k == j) for j in range(5)) for k in range(7)),
)
PHONE = [
    ("attention_pipeline_diagram", (5, 5, 4, 4), {"mask": False}),  # putting it together
    ("attention_pipeline_diagram", (5, 5, 4, 4), {"mask": True}),
    ("attention_pipeline_diagram", (5, 7, 4, 6), {"mask": False, "compact": True}),  # notation
    ("attention_pipeline_diagram", (3, 5, 7, 2), {}),
    ("attention_pipeline_diagram", (1, 7, 1, 1), {}),
    ("attention_pipeline_diagram", (1024, 1024, 64, 64), {}),
    ("attention_pipeline_diagram", (1024, 1024, 64, 64), {"compact": True}),
    ("mask_geometry_diagram", (6, 6), {"window": 3, "lengths": (4,)}),  # masking
    ("mask_geometry_diagram", (3, 7), {"window": 2, "lengths": (5,)}),
    ("mask_geometry_diagram", (5, 3), {}),
    ("mask_geometry_diagram", (32, 32), {"lengths": (3, 20, 32)}),
    ("token_qkv_diagram", PAGE_TOKEN, {"token": "it"}),
    ("token_qkv_diagram", ((1,) * 48, ((1,) * 48,) * 48, ((1,) * 48,) * 48, ((1,) * 48,) * 48), {}),
]


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    PHONE,
    ids=[f"{n.removesuffix('_diagram')}-{i}" for i, (n, _, _) in enumerate(PHONE)],
)
def test_diagram_reads_on_a_phone(name, args, kwargs):
    # The book's limits: text at least 9 CSS px on a 390 px phone, 10 px at 1280 px.
    fig = build(name, *args, **kwargs)
    assert_reads_on_a_phone(fig)
    assert fig.get_size_inches()[0] <= 4.4 + 1e-9


def test_smallest_text_px_reads_a_subscript_at_seventy_percent():
    # Hand-computed: a 3 in canvas (3.2 in saved, 307 px: not shrunk on the phone) with one
    # subscript at 11 pt: 0.7 * 11 pt = 7.7 pt = 10.27 px; at 6 in (6.2 in saved, 595 px) the
    # phone shrinks it by 342 / 595.2.
    for width, phone in ((3.0, 7.7 * 4 / 3), (6.0, 7.7 * 4 / 3 * 342 / (6.2 * 96))):
        fig, ax = dg.new_canvas(width, 1.0)
        ax.text(0.5, 0.5, "$W_Q$", fontsize=11)
        ax.text(width - 0.5, 0.5, "ab", fontsize=11)
        px = smallest_text_px(fig)
        assert px["desktop"] == pytest.approx(7.7 * 4 / 3, rel=1e-3)
        assert px["phone"] == pytest.approx(phone, rel=2e-3)


def test_every_public_drawing_function_is_exported():
    # The API page documents sdpa_book.diagrams by its __all__: a public function or class
    # defined in one of its modules but missing there would go undocumented.
    import importlib
    import inspect
    import pkgutil

    exported = set(dg.__all__)
    assert all(hasattr(dg, name) for name in exported)
    for info in pkgutil.iter_modules(dg.__path__):
        module = importlib.import_module(f"{dg.__name__}.{info.name}")
        for name, obj in vars(module).items():
            defined_here = getattr(obj, "__module__", None) == module.__name__
            public = not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            if defined_here and public:
                assert name in exported, f"{module.__name__}.{name} is public but not exported"
    for name in dg.__all__:  # each function and class with its docstring (the colours: strings)
        obj = getattr(dg, name)
        assert isinstance(obj, str) or obj.__doc__, name
