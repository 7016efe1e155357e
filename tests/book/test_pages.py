"""The book's pages follow the conventions of CONTRIBUTING.md ("Writing a book page").

Two sources are checked:

* the **built site** (``_build/html``): every code cell a reader sees without opening anything
  teaches, so it holds no ``glue(``, ``assert`` or ``np.testing``, at most ``MAX_LINES`` lines
  of code and no line over 88 characters;
* the **MyST sources** (``book/``): every page opens with an "On this page" box; every exercise
  uses the one markup (an ``exercise`` admonition, a ``solution`` dropdown right after it, the
  solution's code in a labelled ``hide-cell`` cell); and the book keeps at least as many glued
  values and asserted claims as it had when this check was written.

The site checks skip when the site is not built (``make html``), except under
``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.

"""

from __future__ import annotations

import ast
import builtins
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
SITE = Path(os.environ.get("SDPA_SITE_DIR", ROOT / "_build" / "html"))
REQUIRE = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"

MAX_LINE = 88
MAX_LINES = 15  # lines of code in one visible cell, blank lines not counted
FORBIDDEN = [("glue(", "a glue call"), ("np.testing", "an np.testing check")]
ASSERT = re.compile(r"^\s*assert\b", re.M)

# The book's totals when the pages were first checked (2026-11-23): 396 glued names referenced
# by the text and 367 assertion lines. Moving a check to another page is fine; losing one is not.
MIN_GLUED_NAMES = 396
MIN_ASSERTIONS = 367

# Pages with no "On this page" box: the landing page and reference pages that are lists.
NO_OVERVIEW = {"index.md", "appendix/api.md", "appendix/bibliography.md", "appendix/glossary.md"}
NO_OVERVIEW |= {f"appendix/api/{p.name}" for p in (BOOK / "appendix" / "api").glob("*.md")}

SOURCES = sorted(
    p for p in BOOK.rglob("*.md") if "_static" not in p.parts and "_templates" not in p.parts
)


def _rel(path: Path) -> str:
    return path.relative_to(BOOK).as_posix()


def _pages(exclude=frozenset()) -> list:
    """Source pages as test parameters, named by their path under ``book/``."""
    return [
        pytest.param(_rel(path), id=_rel(path)) for path in SOURCES if _rel(path) not in exclude
    ]


def _code_cells(text: str) -> list[tuple[list[str], str]]:
    """The code cells of a MyST notebook: (tags, source) for each ``{code-cell}`` block."""
    cells = []
    for match in re.finditer(r"^```\{code-cell\}[^\n]*\n(.*?)^```\s*$", text, re.M | re.S):
        body = match.group(1)
        tags: list[str] = []
        tag_line = re.search(r"^:tags:\s*\[([^\]]*)\]", body, re.M)
        if tag_line:
            tags = [t.strip().strip("'\"") for t in tag_line.group(1).split(",") if t.strip()]
        code = "\n".join(line for line in body.splitlines() if not line.startswith(":"))
        cells.append((tags, code))
    return cells


# ---------------------------------------------------------------------------------------------
# The built site


def _site_pages() -> list[Path]:
    if not (SITE / "index.html").exists():
        return []
    return [SITE / _rel(p).replace(".md", ".html") for p in SOURCES]


def _visible_code(html_path: Path) -> list[str]:
    """The code of each cell whose input a reader sees without opening a toggle."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html_path.read_text(encoding="utf-8"), "html.parser")
    found = []
    for cell_input in soup.select("div.cell div.cell_input"):
        if cell_input.find_parent("details") is not None:
            continue  # hide-input / hide-cell: folded away
        pre = cell_input.find("pre")
        if pre is not None:
            found.append(pre.get_text())
    return found


@pytest.fixture(scope="module")
def site_pages() -> list[Path]:
    pages = _site_pages()
    if not pages:
        reason = f"the site is not built: no {SITE / 'index.html'}; run `make html` first"
        if REQUIRE:
            pytest.fail(reason)
        pytest.skip(reason)
    return pages


def _problems_in_cell(code: str) -> list[str]:
    problems = [f"contains {what}" for needle, what in FORBIDDEN if needle in code]
    if ASSERT.search(code):
        problems.append("contains an assert")
    lines = [line for line in code.splitlines() if line.strip()]
    long = [line for line in lines if len(line) > MAX_LINE]
    if long:
        problems.append(f"{len(long)} line(s) over {MAX_LINE} characters, e.g. {long[0][:60]!r}...")
    if len(lines) > MAX_LINES:
        problems.append(f"{len(lines)} lines of code (at most {MAX_LINES})")
    return problems


@pytest.mark.parametrize("page", _pages())
def test_visible_code_cells_only_teach(site_pages, page):
    html = SITE / page.replace(".md", ".html")
    assert html.exists(), f"{page}: not built"
    problems = []
    for i, code in enumerate(_visible_code(html)):
        for problem in _problems_in_cell(code):
            first = code.strip().splitlines()[0][:50] if code.strip() else ""
            problems.append(f"visible cell {i} ({first!r}): {problem}")
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


def test_the_cell_check_catches_what_it_should():
    assert _problems_in_cell("x = 1\nglue('a', x)") == ["contains a glue call"]
    assert _problems_in_cell("assert x == 1") == ["contains an assert"]
    assert _problems_in_cell("np.testing.assert_allclose(a, b)") == ["contains an np.testing check"]
    assert _problems_in_cell("y = 2  # an assertion in words is fine") == []
    assert "over 88 characters" in _problems_in_cell("x = " + "1" * 90)[0]
    assert _problems_in_cell("\n".join(f"x{i} = {i}" for i in range(16))) == [
        "16 lines of code (at most 15)"
    ]


def test_visible_code_reader_skips_folded_cells(tmp_path):
    page = tmp_path / "p.html"
    page.write_text(
        '<div class="cell"><div class="cell_input"><pre>a = 1</pre></div></div>'
        '<div class="cell"><details><div class="cell_input"><pre>assert a</pre></div></details></div>',
        encoding="utf-8",
    )
    assert _visible_code(page) == ["a = 1"]


# ---------------------------------------------------------------------------------------------
# The sources


@pytest.mark.parametrize("page", _pages(exclude=NO_OVERVIEW))
def test_page_opens_with_an_overview(page):
    text = (BOOK / page).read_text(encoding="utf-8")
    title = re.search(r"^# .+$", text, re.M)
    assert title, f"{page}: no title"
    after = text[title.end() :]
    box = re.match(
        r"\s*:{3,}\{admonition\} On this page\n:class: overview\n(.*?)\n:{3,}", after, re.S
    )
    assert box, f"{page}: the first thing after the title must be the 'On this page' box"
    body = box.group(1)
    points = re.findall(r"^- ", body.split("**You need**")[0], re.M)
    assert "**You will learn**" in body and 3 <= len(points) <= 5, (
        f"{page}: 'You will learn' needs 3 to 5 points; found {len(points)}"
    )
    assert "**You need**" in body, f"{page}: say what the page assumes ('**You need**')"


def _exercise_problems(text: str) -> list[str]:
    problems = []
    for match in re.finditer(r"^(:{3,})\{admonition\} (Exercise[^\n]*)\n", text, re.M):
        fence, title = match.group(1), match.group(2)
        rest = text[match.end() :]
        if not rest.startswith(":class: exercise\n"):
            problems.append(f"{title!r}: needs ':class: exercise'")
        close = re.search(rf"^{fence}\s*$", rest, re.M)
        if close is None:
            problems.append(f"{title!r}: not closed")
            continue
        after = rest[close.end() :].lstrip("\n")
        solution = re.match(r"(:{3,})\{dropdown\} Solution\n:class-container: solution\n", after)
        if solution is None:
            problems.append(
                f"{title!r}: must be followed by a 'Solution' dropdown with class solution"
            )
            continue
        sol_rest = after[solution.end() :]
        sol_close = re.search(rf"^{solution.group(1)}\s*$", sol_rest, re.M)
        body = sol_rest[: sol_close.start()] if sol_close else sol_rest
        if not re.search(r"\{glue(:\w+)?\}`", body):
            problems.append(f"{title!r}: the written solution states no glued number")
    # Anything that looks like an exercise in another markup.
    for match in re.finditer(r"^:{3,}\{(?!admonition\} Exercise)[^}]*\}[^\n]*Exercise", text, re.M):
        problems.append(f"exercise in another markup: {match.group(0)!r}")
    for tags, _code in _code_cells(text):
        if "solution" in tags:
            if "hide-cell" not in tags:
                problems.append("a solution's code cell must be tagged hide-cell")
    for match in re.finditer(
        r"^```\{code-cell\}[^\n]*\n(:tags:[^\n]*solution[^\n]*\n(?::[^\n]*\n)*)", text, re.M
    ):
        if "Show the solution's code" not in match.group(1):
            problems.append("a solution's code cell must be labelled \"Show the solution's code\"")
    return problems


@pytest.mark.parametrize("page", _pages())
def test_exercises_use_the_one_markup(page):
    problems = _exercise_problems((BOOK / page).read_text(encoding="utf-8"))
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


def test_the_exercise_check_catches_old_markup():
    old = "::::{admonition} Exercise 1: x\n:class: tip\n\nQ\n::::\n"
    assert any("class: exercise" in p for p in _exercise_problems(old))
    detached = (
        "::::{admonition} Exercise 1: x\n:class: exercise\n\nQ\n::::\n\nText.\n"
        ":::{dropdown} Solution\n:class-container: solution\n\nA {glue:text}`n`.\n:::\n"
    )
    assert any("followed by a 'Solution'" in p for p in _exercise_problems(detached))
    no_number = (
        "::::{admonition} Exercise 1: x\n:class: exercise\n\nQ\n::::\n\n"
        ":::{dropdown} Solution\n:class-container: solution\n\nIt is large.\n:::\n"
    )
    assert any("no glued number" in p for p in _exercise_problems(no_number))
    good = no_number.replace("It is large.", "It is {glue:text}`n:.2f`.")
    assert _exercise_problems(good) == []


# A reader runs the visible cells alone (copied into a console, or with the hidden cells
# skipped), so every name a visible cell uses must come from an earlier visible cell (or the
# same cell), an import or a builtin; and a hidden cell must not rebind a name that visible code
# uses afterwards, or the reader's value differs from the page's (a silent change of shape).
# Hidden cells may use the visible names freely. "Visible" means the input is on the page:
# every cell except those tagged remove-cell or remove-input (folded cells can be opened).
HIDDEN_INPUT = {"remove-cell", "remove-input"}
BUILTIN_NAMES = set(dir(builtins)) | {"display", "get_ipython"}


class _ModuleNames(ast.NodeVisitor):
    """The names one top-level statement loads and binds in the module's scope.

    Loads inside a function body are ``deferred``: they resolve when the function is called,
    so they are checked against the names bound at the end of the cell that defines it.
    Comprehensions and lambdas keep their own variables to themselves.
    """

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.binds: list[str] = []
        self.deferred: list[str] = []

    def visit_Name(self, node: ast.Name) -> None:
        (self.loads if isinstance(node.ctx, ast.Load) else self.binds).append(node.id)

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.binds += [(alias.asname or alias.name).split(".")[0] for alias in node.names]

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.binds.append(node.name)
        self.generic_visit(node)

    @staticmethod
    def _params(args: ast.arguments) -> set[str]:
        names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        return set(names) | {a.arg for a in (args.vararg, args.kwarg) if a is not None}

    def _inner(self, nodes, local: set[str], into: list[str]) -> None:
        inner = _ModuleNames()
        for node in nodes:
            inner.visit(node)
        local = local | set(inner.binds)
        into += [name for name in inner.loads + inner.deferred if name not in local]

    def visit_FunctionDef(self, node) -> None:
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self._inner(node.body, self._params(node.args), self.deferred)
        self.binds.append(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.bases, *node.decorator_list]:
            self.visit(expr)
        self._inner(node.body, set(), self.loads)
        self.binds.append(node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._inner([node.body], self._params(node.args), self.deferred)

    def _comprehension(self, node, parts) -> None:
        first, *rest = node.generators
        self.visit(first.iter)
        targets = _ModuleNames()
        for gen in node.generators:
            targets.visit(gen.target)
        body = [gen.iter for gen in rest] + [c for gen in node.generators for c in gen.ifs]
        self._inner(body + parts, set(targets.binds), self.loads)

    def visit_ListComp(self, node) -> None:
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._comprehension(node, [node.key, node.value])


def _unbound_problems(text: str) -> list[str]:
    """Names a visible cell uses that no earlier visible code binds (see above)."""
    bound_by: dict[str, str] = {}  # name -> "visible" or "hidden": its latest binding
    ever_visible: set[str] = set()  # names some visible cell has bound
    problems = []

    def check(name: str, cell: int, first: str) -> None:
        where = bound_by.get(name)
        if where == "visible" or (where is None and name in BUILTIN_NAMES):
            return
        if where is None:
            why = "not bound by any earlier cell"
        elif name in ever_visible:
            why = "rebound by a hidden cell since its last visible binding"
        else:
            why = "bound only by a hidden cell"
        problems.append(f"code cell {cell} ({first!r}): {name!r} is {why}")

    for cell, (tags, code) in enumerate(_code_cells(text)):
        hidden = bool(HIDDEN_INPUT & set(tags))
        code = "\n".join(
            line for line in code.splitlines() if not line.lstrip().startswith(("%", "!"))
        )
        first = code.strip().splitlines()[0][:40] if code.strip() else ""
        deferred: list[str] = []
        for statement in ast.parse(code).body:
            names = _ModuleNames()
            names.visit(statement)
            # A compound statement (for, with, if, def) may load what it binds itself.
            simple = isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr))
            own = set() if simple else set(names.binds)
            if not hidden:
                for name in dict.fromkeys(names.loads):
                    if name not in own:
                        check(name, cell, first)
                deferred += names.deferred
            for name in names.binds:
                bound_by[name] = "hidden" if hidden else "visible"
                if not hidden:
                    ever_visible.add(name)
        for name in dict.fromkeys(deferred):
            check(name, cell, first)
    return problems


@pytest.mark.parametrize("page", _pages())
def test_visible_code_runs_without_the_hidden_cells(page):
    problems = _unbound_problems((BOOK / page).read_text(encoding="utf-8"))
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


def _page_of(*cells: tuple[str, str]) -> str:
    """A MyST page made of code cells, each given as (tags, code)."""
    out = []
    for tags, code in cells:
        tag_line = f":tags: [{tags}]\n" if tags else ""
        out.append(f"```{{code-cell}} ipython3\n{tag_line}{code}\n```\n")
    return "\n".join(out)


def test_the_unbound_check_catches_what_it_should():
    # A name only a hidden cell defines, and a visible name a hidden cell rebinds.
    page = _page_of(
        ("", "import numpy as np\nq = np.ones((6, 8))"),
        ("remove-cell", "q = np.ones((4, 3))\ncat = 1"),
        ("", "print(q.shape, cat)"),
    )
    problems = _unbound_problems(page)
    assert len(problems) == 2, problems
    assert "'q' is rebound by a hidden cell" in problems[0]
    assert "'cat' is bound only by a hidden cell" in problems[1]
    assert "not bound" in _unbound_problems(_page_of(("", "print(ratios[0])")))[0]
    assert "not bound" in _unbound_problems(_page_of(("", "x = x + 1")))[0]
    # What is fine: builtins, names bound in the same statement or cell, function bodies that
    # use a name bound later in their cell, comprehension and lambda variables, hidden cells
    # using visible names, folded (hide-cell) cells using visible names.
    fine = _page_of(
        ("", "import numpy as np\nfor k in range(3):\n    total = k if k == 0 else total + k"),
        ("", "def f(x):\n    return np.exp(x) * T\n\nT = 2\nsquares = [i * i for i in range(T)]"),
        ("", "g = lambda *a, **kw: f(*a)\ntry:\n    g(1)\nexcept ValueError as e:\n    e"),
        ("remove-cell", "assert f(0) == T\nhelper = 1"),
        ("hide-cell, solution", "print(squares, total, g(0), {t: t for t in range(T)})"),
    )
    assert _unbound_problems(fine) == []


def _glued_names(text: str) -> set[str]:
    roles = re.findall(r"\{glue(?::\w+)?\}`([^`:]+)", text)
    blocks = re.findall(r"^(?:`{3,}|:{3,})\{glue(?::\w+)?\}\s+(\S+)", text, re.M)
    return set(roles) | set(blocks)


def test_the_book_keeps_its_glued_numbers_and_assertions():
    names = sum(len(_glued_names(p.read_text(encoding="utf-8"))) for p in SOURCES)
    asserts = 0
    for p in SOURCES:
        for _, code in _code_cells(p.read_text(encoding="utf-8")):
            asserts += len(re.findall(r"^\s*(?:assert\b|np\.testing\.assert)", code, re.M))
    assert names >= MIN_GLUED_NAMES, (
        f"{names} glued names referenced; the book had {MIN_GLUED_NAMES}"
    )
    assert asserts >= MIN_ASSERTIONS, f"{asserts} assertion lines; the book had {MIN_ASSERTIONS}"


# A bound stated in the prose must hold as printed: a glued number after "within", "at most",
# "less than", "more than", "above", "below" or "under" is rounded up (sdpa_book.round_up), one
# after "at least" or "never below" rounded down, since formatting alone rounds to the nearest and can print a
# bound the measurement breaks. Exact integers (int(...), len(...)) need no rounding.
_LOWER_WORDS = ["at least", "never below", "never under"]
_UPPER_WORDS = ["within", "at most", "less than", "more than", "above", "below", "under"]
_WORDS = "|".join(w.replace(" ", r"\s+") for w in _LOWER_WORDS + _UPPER_WORDS)
_BOUND = re.compile(r"\b(?P<word>" + _WORDS + r")\s+\{glue:text\}`(?P<name>[\w-]+)(?::[^`]*)?`")
# Not bounds on a measurement: thresholds shown as the visible cell prints them ("exp
# overflows above 88.72"). The package's constants (tiled.LAZY_MARGIN) are exact too.
NOT_BOUNDS = {"exp-limit-float16", "exp-limit-float32", "exp-limit-float64"}
_CONSTANT = re.compile(r"(\w+\.)*[A-Z][A-Z0-9_]+\s*,")


def _bound_problems(text: str) -> list[str]:
    glued = dict(re.findall(r'glue\(\s*"([\w-]+)",\s*(.+)', text))
    problems = []
    for m in _BOUND.finditer(text):
        name, expr = m["name"], glued.get(m["name"], "")
        lower = " ".join(m["word"].split()) in _LOWER_WORDS
        want = "round_down(" if lower else "round_up("
        exact = expr.startswith(("int(", "len(")) or _CONSTANT.match(expr)
        if name in NOT_BOUNDS or exact or expr.startswith(want):
            continue
        problems.append(f"{m['word']} {name}: glues {expr[:50]!r}, not {want}...)")
    return problems


@pytest.mark.parametrize("page", _pages())
def test_bounds_in_the_prose_hold_as_printed(page):
    problems = _bound_problems((BOOK / page).read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_bound_check_catches_what_it_should():
    def page(word, expr):
        return f'Errors {word} {{glue:text}}`e:.2g`.\n```\nglue("e", {expr}, display=False)\n```'

    assert _bound_problems(page("within", "err.max()"))
    assert _bound_problems(page("at least", "round_up(p, 2)"))
    assert _bound_problems(page("above", "round_down(x, 2)"))
    assert not _bound_problems(page("within", "round_up(err.max(), 2)"))
    assert not _bound_problems(page("at least", "round_down(p, 3)"))
    assert not _bound_problems(page("more than", "int(count)"))
    assert not _bound_problems(page("at most", "tiled.LAZY_MARGIN"))  # a constant
    assert _bound_problems(page("at most", "tiled.LAZY_MARGIN * err"))
    assert not _bound_problems(page("of", "err.max()"))  # not a bound
    assert _bound_problems(page("never\nbelow", "round_up(m, 3)"))  # a lower bound
    assert _bound_problems(page("more\nthan", "m.max()"))


def test_glue_comes_from_sdpa_book():
    offenders = [_rel(p) for p in SOURCES if "myst_nb" in p.read_text(encoding="utf-8")]
    assert not offenders, f"pages importing myst_nb (use `from sdpa_book import glue`): {offenders}"


# ---------------------------------------------------------------------------------------------
# The landing page


def _toctree_docs() -> list[str]:
    """Every page in the landing page's tables of contents, in order (``formula/softmax``)."""
    text = (BOOK / "index.md").read_text(encoding="utf-8")
    docs = []
    for block in re.findall(r"^```\{toctree\}\n(.*?)^```", text, re.M | re.S):
        docs += [
            line.strip() for line in block.splitlines() if line.strip() and not line.startswith(":")
        ]
    return docs


def test_landing_page_leads_the_reader_in(site_pages):
    """The landing page opens with a computed figure, says what a reader will be able to do,
    offers three reading paths, lists every chapter with its reading time, and links to the
    page that ships the code."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup((SITE / "index.html").read_text(encoding="utf-8"), "html.parser")
    article = soup.select_one("article")
    first_heading = article.find("h2")
    hook = first_heading.find_all_previous("figure")
    assert hook, "no figure before the first section: the hook comes before everything else"
    assert hook[0].find("img") is not None, "the hook figure has no image"
    numbers = re.findall(r"\b0\.\d\d\b", hook[0].get_text())
    assert len(numbers) >= 3, (
        f"the hook's caption states no computed weights: {hook[0].get_text()!r}"
    )

    sections = {
        h.get_text(strip=True).rstrip("#¶"): h.find_parent("section")
        for h in article.find_all("h2")
    }
    able = sections["You will be able to"].find("ul")
    assert able is not None and len(able.find_all("li")) >= 5
    paths = sections["Three ways in"].find_all("dt")
    assert len(paths) == 3, [p.get_text() for p in paths]

    chapters = sections["The chapters"]
    listed = {}
    for item in chapters.find_all("li"):
        link = item.find("a", href=True)
        minutes = re.search(r"\((\d+) min\)", item.get_text())
        assert link is not None and minutes, (
            f"a chapter line without a link or a time: {item.get_text()!r}"
        )
        listed[link["href"].split("#")[0].removesuffix(".html")] = int(minutes.group(1))
    chapters_in_toc = [
        doc
        for doc in _toctree_docs()
        if not doc.startswith("appendix/") and doc != "run-it-yourself"
    ]
    assert list(listed) == chapters_in_toc, "the chapter list and the table of contents differ"
    assert all(1 <= m <= 60 for m in listed.values()), listed
    assert len(set(listed.values())) > 3, "every page has the same reading time: not computed"
    assert article.find("a", href=re.compile(r"^run-it-yourself\.html")) is not None


def test_api_summary_signatures_wrap_between_arguments(site_pages):
    """book/_ext/sdpa_api.py replaces autosummary's no-break spaces, so a narrow column breaks a signature
    after a comma, never inside a name."""
    from bs4 import BeautifulSoup

    html = (SITE / "appendix" / "api" / "sdpa.html").read_text(encoding="utf-8")
    tables = BeautifulSoup(html, "html.parser").select("table.autosummary")
    assert tables, "the API page has no autosummary table"
    texts = [table.get_text() for table in tables]
    assert any("head_dim" in text for text in texts)  # signatures are there
    assert not any("\xa0" in text for text in texts)


def test_bibliography_links_back_to_every_citation(site_pages):
    """Each work in the bibliography links back to the pages that cite it, at the citation,
    and every citation in the book is linked from its entry (book/_ext/sdpa_citations.py)."""
    from bs4 import BeautifulSoup

    page = SITE / "appendix" / "bibliography.html"
    soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
    entries = soup.select("div.citation")
    assert entries, "the bibliography lists no work"
    linked = set()
    ids = {}  # each cited page's element ids, each page parsed once, not once a link (20 s to 4.5)
    for entry in entries:
        back = entry.select_one("p.sdpa-cited-in")
        assert back is not None, f"no 'Cited in' line under {entry.get_text()[:60]!r}"
        for link in back.find_all("a", href=True):
            target, _, anchor = link["href"].partition("#")
            html = (page.parent / target).resolve()
            assert html.is_file(), link["href"]
            if html not in ids:
                cited = BeautifulSoup(html.read_text(encoding="utf-8"), "html.parser")
                ids[html] = {tag["id"] for tag in cited.find_all(id=True)}
            assert anchor in ids[html], f"no anchor {anchor!r} in {target}"
            linked.add(html.relative_to(SITE.resolve()).as_posix().removesuffix(".html"))
    citing = {_rel(p).removesuffix(".md") for p in SOURCES if "{cite" in p.read_text("utf-8")}
    assert citing <= linked, f"pages citing a work but not linked back: {citing - linked}"
