"""The reader's notebook of a page, tried on a tiny book that uses every MyST construct the pages use.

The book is built with the project's own conf.py (as in ``test_build.py``); the notebook that
``book/_ext/sdpa_notebooks.py`` writes into ``_sources/`` must read as the page does, in plain
Jupyter Markdown: glued values in place, references and citations as text, figures with their
captions, dropdowns as ``<details>``, hidden cells kept and marked. The expected texts below are
written from the page's source by hand.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRE = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"

INDEX = """\
# A tiny book

```{toctree}
page
bib
```
"""

BIBLIOGRAPHY = """\
# Bibliography

```{bibliography}
```
"""

PAGE = textwrap.dedent(
    r"""
    ---
    file_format: mystnb
    kernelspec:
      name: python3
      display_name: Python 3
    ---

    (tiny)=
    # Tiny page

    Attention is older than {cite:t}`vaswani2017attention`, who named it {cite:p}`vaswani2017attention`.
    The ratio is {glue:text}`ratio:.3f` and the count is {glue}`count`; see {ref}`second`,
    {numref}`fig-line`, {doc}`index`, {func}`twice` and equation {eq}`eq-sum`. A literal `$5` costs
    *5 dollars* and **no** 2*3.

    ```{code-cell} ipython3
    :tags: [remove-cell]
    import matplotlib.pyplot as plt
    from sdpa_book import glue, markdown_table
    ```

    ```{code-cell} ipython3
    ratio = 1 / 3
    print("ratio", round(ratio, 4))
    ```

    ```{code-cell} ipython3
    :tags: [remove-input]
    glue("ratio", ratio, display=False)
    glue("count", 7, display=False)
    assert 0 < ratio < 1
    ```

    $$
    s = a + b
    $$ (eq-sum)

    ```{code-cell} ipython3
    :tags: [remove-cell]
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1], [0, 1])
    glue("fig-line", fig, display=False)
    plt.close(fig)
    ```

    :::{glue:figure} fig-line
    :alt: A rising line.
    :name: fig-line

    A line, from $(0, 0)$ to $(1, 1)$.
    :::

    (second)=
    ## Second section

    | key | value |
    |:--|--:|
    | a | 1 |

    ```{eval-rst}
    .. py:function:: twice(x)

       Twice ``x``.
    ```

    ```{code-cell} ipython3
    :tags: [remove-input]
    markdown_table([["b", 2]], ["key", "value"])
    ```

    :::{note}
    A note with a list:

    - one
    - two
    :::

    ::::{admonition} Exercise 1: halve it
    :class: exercise

    Halve the ratio.
    ::::

    :::{dropdown} Solution
    :class-container: solution

    Half of it is {glue:text}`ratio:.2f` halved.
    :::

    ```{code-cell} ipython3
    :tags: [hide-cell, solution]
    :mystnb:
    :  code_prompt_show: "Show the solution's code"
    :  code_prompt_hide: "Hide the solution's code"
    ratio / 2
    ```

    ```{code-cell} ipython3
    :tags: [hide-input]
    print("hidden input")
    ```

    ```{code-cell} ipython3
    :tags: [remove-output]
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.bar([0, 1], [1, 2])
    glue("fig-bars", fig, display=False)
    plt.close(fig)
    ```

    Prose between the cell that draws a figure and the figure.

    :::{glue:figure} fig-bars
    :alt: Two bars.
    :name: fig-bars

    Two bars.
    :::
    """
).lstrip()


@pytest.fixture(scope="module")
def notebook(tmp_path_factory) -> dict:
    """The tiny book, built once; the reader's notebook of its page."""
    if not (ROOT / "node_modules" / "mathjax").is_dir():
        reason = "MathJax is not installed: run `make node_modules` (npm ci) first"
        pytest.fail(reason) if REQUIRE else pytest.skip(reason)
    project = tmp_path_factory.mktemp("export")
    shutil.copy2(ROOT / "conf.py", project / "conf.py")
    (project / "node_modules").symlink_to(ROOT / "node_modules", target_is_directory=True)
    book = project / "book"
    for folder in ("_static", "_templates", "references", "_ext"):
        shutil.copytree(
            ROOT / "book" / folder, book / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    (book / "index.md").write_text(INDEX)
    (book / "page.md").write_text(PAGE)
    (book / "bib.md").write_text(BIBLIOGRAPHY)
    (project / "src" / "sdpa").mkdir(parents=True)
    (project / "src" / "sdpa" / "__init__.py").write_text("")
    command = [
        sys.executable, "-m", "sphinx", "-b", "html", "-c", str(project), str(book),
        str(project / "_build" / "html"), "-d", str(project / "_build" / "doctrees"),
        "-n", "-W", "--keep-going", "-q", "-D", "numfig=1",
    ]  # fmt: skip
    env = {**os.environ, "SDPA_NB_EXECUTION_MODE": "cache", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    result = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    path = project / "_build" / "html" / "_sources" / "page.ipynb"
    return json.loads(path.read_text(encoding="utf-8"))


def _cells(notebook: dict) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in notebook["cells"]]


def _markdown(notebook: dict) -> str:
    return "\n\n".join(text for kind, text in _cells(notebook) if kind == "markdown")


def test_no_myst_is_left(notebook):
    text = _markdown(notebook)
    assert not re.search(r"\{[a-z][\w:-]*\}`", text), text
    assert not re.search(r"^\s*(```|:::)\s*\{", text, re.M), text


def test_glued_values_references_and_citations_read_as_text(notebook):
    text = _markdown(notebook)
    # cite:t then cite:p, in the book's author-year style; brackets escaped for Markdown.
    assert (
        "Attention is older than Vaswani *et al.* \\[2017\\], who named it \\[Vaswani *et al.*, 2017\\]."
        in text
    )
    # {glue:text}`ratio:.3f` of 1/3, and {glue}`count` of 7
    assert "The ratio is 0.333 and the count is 7;" in text
    # {ref} gives the section title, {numref} the figure's number, {doc} the page's title,
    # {func} the function's name as code, {eq} the equation's number.
    assert "see *Second section*, *Fig. 1*, *A tiny book*, `twice()` and equation (1)." in text
    # A dollar sign is escaped, so Jupyter does not start maths; emphasis stays emphasis.
    assert "A literal `$5` costs *5 dollars* and **no** 2\\*3." in text


def test_cited_works_are_listed_at_the_end(notebook):
    kind, last = _cells(notebook)[-1]
    assert kind == "markdown" and last.startswith("## References\n\n- ")
    assert "Attention is all you need" in last


def test_maths_figures_tables_and_admonitions(notebook):
    text = _markdown(notebook)
    assert "$$\ns = a + b\n\\tag{1}\n$$" in text
    # The figure is the output of the hidden cell right above: only its caption is written.
    assert "**Fig. 1.** A line, from $(0, 0)$ to $(1, 1)$." in text
    assert "| key | value |\n|:--|--:|\n| a | 1 |" in text
    assert "> **Note**\n>\n> A note with a list:\n>\n> - one\n> - two" in text
    assert "`twice(x)`\n\n> Twice `x`." in text  # a py:function entry
    assert "> **Exercise 1: halve it**\n>\n> Halve the ratio." in text
    assert (
        "<details>\n<summary>Solution</summary>\n\nHalf of it is 0.33 halved.\n\n</details>" in text
    )


def test_hidden_cells_stay_marked_and_folded(notebook):
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    first_lines = ["".join(c["source"]).splitlines()[0] for c in code]
    assert first_lines == [
        "# Hidden on the website: this cell imports what the page needs.",
        "ratio = 1 / 3",
        "# The website shows only this cell's output: this cell passes 2 values to the text and"
        " checks what the text claims.",
        "# Hidden on the website: this cell draws the figure.",
        "# The website shows only this cell's output: this cell writes the table.",
        '# Folded on the website behind "Show the solution\'s code".',
        "# The website folds this cell's code.",
        "# The website shows this cell's code without its output: this cell draws the figure.",
    ]
    hidden = [c["metadata"].get("jupyter", {}) for c in code]
    assert [h.get("source_hidden", False) for h in hidden] == [
        True,
        False,
        True,
        True,
        True,
        True,
        True,
        False,
    ]
    assert hidden[5].get("outputs_hidden") is True  # hide-cell folds the output too
    # ... but not the figure a cell glues: the site shows it where the text does.
    assert hidden[7].get("outputs_hidden") is False


def test_code_cells_keep_their_outputs_and_glued_figures(notebook):
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    # The visible cell's print, as the build ran it.
    assert "".join(code[1]["outputs"][0]["text"]) == "ratio 0.3333\n"
    # The figure glued with display=False is where sdpa_book.glue shows it outside the build:
    # an output of the cell that glued it (and not an attachment of the caption's cell).
    assert any(k.startswith("image/") for k in code[3]["outputs"][0]["data"])
    assert any(k.startswith("image/") for k in code[7]["outputs"][0]["data"])
    # Where prose comes between the cell and the figure, the figure is also in the text.
    attached = [
        c for c in notebook["cells"] if c["cell_type"] == "markdown" and c.get("attachments")
    ]
    assert len(attached) == 1
    (name,) = attached[0]["attachments"]
    text = "".join(attached[0]["source"])
    assert text.endswith(f"![Two bars.](attachment:{name})\n\n**Fig. 2.** Two bars.")
    assert list(attached[0]["attachments"][name]) == ["image/svg+xml"]
    # Plain numbers glued with display=False are not outputs (the text states them).
    assert code[2]["outputs"] == []
    assert "glue" not in json.dumps([c["outputs"] for c in code])  # no glue metadata left


def test_the_notebook_header_says_what_it_is(notebook):
    kind, header = _cells(notebook)[0]
    assert kind == "markdown"
    assert header.startswith("> This notebook is the page **Tiny page** of *")
    assert f"(Python {sys.version_info[0]}.{sys.version_info[1]}." in header
