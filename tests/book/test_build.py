"""The book's build machinery, tried on tiny books built with the project's own conf.py.

* A cell that raises fails the build (non-zero exit, the exception in the output).
* The execution cache never serves stale outputs: a page runs once, is not run again when
  nothing changed, and runs again when only the package changed (its own code did not).
* Executed pages are offered as notebooks next to their MyST source.
* A parallel build reads each slow page in a process of its own, ahead of the others.

Each test copies ``conf.py`` into a temporary project with its own small ``src/sdpa`` package,
so the real package is never touched; MathJax comes from the project's ``node_modules``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRE = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"

FRONT_MATTER = """\
---
file_format: mystnb
kernelspec:
  name: python3
  display_name: Python 3
---
"""

INDEX = """\
# A tiny book

```{toctree}
page
```
"""

# The page imports the project's (temporary) package, prints a value from it, and appends a line
# to runs.txt each time it executes, so the test can count executions.
PAGE = FRONT_MATTER + textwrap.dedent(
    """\
    (page)=
    # Page

    ```{code-cell} ipython3
    import sys
    from pathlib import Path

    project = Path.cwd().parent
    sys.path.insert(0, str(project / "src"))
    import sdpa

    with open(project / "runs.txt", "a") as runs:
        runs.write("run\\n")
    print(f"package value {sdpa.VALUE}")
    ```
    """
)

FAILING_PAGE = FRONT_MATTER + textwrap.dedent(
    """\
    (page)=
    # Page

    ```{code-cell} ipython3
    print("before the error")
    ```

    ```{code-cell} ipython3
    raise RuntimeError("deliberate failure 7f3a")
    ```
    """
)


def make_project(tmp_path: Path) -> Path:
    """A project folder with the real conf.py, static files, templates and MathJax, and a tiny
    package."""
    if not (ROOT / "node_modules" / "mathjax").is_dir():
        reason = "MathJax is not installed: run `make node_modules` (npm ci) first"
        pytest.fail(reason) if REQUIRE else pytest.skip(reason)
    shutil.copy2(ROOT / "conf.py", tmp_path / "conf.py")
    (tmp_path / "node_modules").symlink_to(ROOT / "node_modules", target_is_directory=True)
    book = tmp_path / "book"
    shutil.copytree(ROOT / "book" / "_static", book / "_static")
    shutil.copytree(ROOT / "book" / "references", book / "references")
    shutil.copytree(ROOT / "book" / "_templates", book / "_templates")
    shutil.copytree(
        ROOT / "book" / "_ext", book / "_ext", ignore=shutil.ignore_patterns("__pycache__")
    )
    (book / "index.md").write_text(INDEX)
    package = tmp_path / "src" / "sdpa"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    return tmp_path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_project(tmp_path)


def build(project: Path) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "sphinx", "-b", "html", "-c", str(project),
        str(project / "book"), str(project / "_build" / "html"),
        "-d", str(project / "_build" / "doctrees"),
        "-n", "-W", "--keep-going", "-q",
    ]  # fmt: skip
    env = {**os.environ, "SDPA_NB_EXECUTION_MODE": "cache", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    return subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=120
    )


def runs(project: Path) -> int:
    path = project / "runs.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def read(path: Path) -> str:
    """The file's text, or "" if the build did not write it (the assertions then say why)."""
    return path.read_text(encoding="utf-8") if path.exists() else ""


def page_html(project: Path) -> str:
    return read(project / "_build" / "html" / "page.html")


def test_a_cell_that_raises_fails_the_build(project):
    (project / "book" / "page.md").write_text(FAILING_PAGE)
    result = build(project)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "RuntimeError" in output and "deliberate failure 7f3a" in output, output


@pytest.fixture(scope="module")
def cache_story(tmp_path_factory) -> dict:
    """Build a one-page book three times: cold, unchanged, and after a change to the package."""
    story = {}
    project = make_project(tmp_path_factory.mktemp("cache"))
    (project / "book" / "page.md").write_text(PAGE)

    story["first"] = build(project)
    story["first_runs"] = runs(project)
    story["first_html"] = page_html(project)
    sources = project / "_build" / "html" / "_sources"
    story["notebook"] = read(sources / "page.ipynb")
    story["source"] = read(sources / "page.md")
    story["index_html"] = read(project / "_build" / "html" / "index.html")

    story["unchanged"] = build(project)
    story["unchanged_runs"] = runs(project)

    # Only the package changes; the page's own code stays as it was.
    (project / "src" / "sdpa" / "__init__.py").write_text("VALUE = 2\n")
    story["changed"] = build(project)
    story["changed_runs"] = runs(project)
    story["changed_html"] = page_html(project)
    return story


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_cold_build_executes_the_page(cache_story):
    _ok(cache_story["first"])
    assert cache_story["first_runs"] == 1
    assert "package value 1" in cache_story["first_html"]


def test_an_unchanged_book_is_not_executed_again(cache_story):
    _ok(cache_story["unchanged"])
    assert cache_story["unchanged_runs"] == 1, "nothing changed, yet the page executed again"


def test_a_package_change_executes_the_page_again(cache_story):
    _ok(cache_story["changed"])
    assert cache_story["changed_runs"] == 2, "the package changed but the page did not execute"
    assert "package value 2" in cache_story["changed_html"]
    assert "package value 1" not in cache_story["changed_html"]


def test_executed_pages_are_offered_as_notebooks(cache_story):
    _ok(cache_story["first"])
    # The theme's download menu links both files, and both are in the site.
    assert 'href="_sources/page.ipynb"' in cache_story["first_html"]
    assert 'href="_sources/page.md"' in cache_story["first_html"]
    assert "package value 1" in cache_story["notebook"]  # executed, with its output
    assert cache_story["source"] == PAGE
    # A page without code is not a notebook and offers only its source.
    assert "page.ipynb" not in cache_story["index_html"]
    assert "index.ipynb" not in cache_story["index_html"]


def test_a_parallel_build_reads_each_slow_page_alone_and_first():
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        import sdpa_parallel
    finally:
        sys.path.remove(str(ROOT / "book" / "_ext"))
    docs = [f"part/page{i:02d}" for i in range(40)]
    sdpa_parallel.SLOW_FIRST[:] = ["part/page30", "absent/page", "part/page05"]
    try:
        chunks = sdpa_parallel.slow_first_chunks(docs, 2)
    finally:
        sdpa_parallel.SLOW_FIRST.clear()
    assert chunks[:2] == [["part/page30"], ["part/page05"]]
    rest = [name for chunk in chunks[2:] for name in chunk]
    assert rest == [name for name in docs if name not in {"part/page30", "part/page05"}]
    assert all(len(chunk) < len(docs) // 2 for chunk in chunks[2:])  # still shared out
