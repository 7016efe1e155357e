"""The book's build machinery, tried on tiny books built with the project's own conf.py.

* A cell that raises fails the build (non-zero exit, the exception in the output).
* The execution cache never serves stale outputs: a page runs once, is not run again when
  nothing changed, and runs again when only the package changed (its own code did not).
* Executed pages are offered as notebooks next to their MyST source.

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

ROOT = Path(__file__).resolve().parents[1]

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


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder with the real conf.py, static files and MathJax, and a tiny package."""
    if not (ROOT / "node_modules" / "mathjax").is_dir():
        pytest.fail("node_modules is missing: run `make node_modules` (npm ci) first")
    shutil.copy2(ROOT / "conf.py", tmp_path / "conf.py")
    (tmp_path / "node_modules").symlink_to(ROOT / "node_modules", target_is_directory=True)
    book = tmp_path / "book"
    shutil.copytree(ROOT / "book" / "_static", book / "_static")
    shutil.copytree(ROOT / "book" / "references", book / "references")
    (book / "index.md").write_text(INDEX)
    package = tmp_path / "src" / "sdpa"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    return tmp_path


def build(project: Path) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "sphinx", "-b", "html", "-c", str(project),
        str(project / "book"), str(project / "_build" / "html"),
        "-d", str(project / "_build" / "doctrees"),
        "-n", "-W", "--keep-going", "-q",
    ]  # fmt: skip
    env = {**os.environ, "SDPA_NB_EXECUTION_MODE": "cache", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=120)


def runs(project: Path) -> int:
    path = project / "runs.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def page_html(project: Path) -> str:
    return (project / "_build" / "html" / "page.html").read_text(encoding="utf-8")


def test_a_cell_that_raises_fails_the_build(project):
    (project / "book" / "page.md").write_text(FAILING_PAGE)
    result = build(project)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "RuntimeError" in output and "deliberate failure 7f3a" in output, output


def test_cache_reexecutes_when_the_package_changes(project):
    (project / "book" / "page.md").write_text(PAGE)

    first = build(project)
    assert first.returncode == 0, first.stdout + first.stderr
    assert runs(project) == 1
    assert "package value 1" in page_html(project)

    unchanged = build(project)
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
    assert runs(project) == 1, "nothing changed, yet the page executed again"

    # Only the package changes; the page's own code is the same as before.
    (project / "src" / "sdpa" / "__init__.py").write_text("VALUE = 2\n")
    changed = build(project)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert runs(project) == 2, "the package changed, but the page was not executed again"
    html = page_html(project)
    assert "package value 2" in html and "package value 1" not in html


def test_executed_pages_are_offered_as_notebooks(project):
    (project / "book" / "page.md").write_text(PAGE)
    result = build(project)
    assert result.returncode == 0, result.stdout + result.stderr
    html = page_html(project)
    sources = project / "_build" / "html" / "_sources"
    # The download menu links both files, and both are in the site.
    assert 'href="_sources/page.ipynb"' in html
    assert 'href="_sources/page.md"' in html
    notebook = (sources / "page.ipynb").read_text(encoding="utf-8")
    assert "package value 1" in notebook  # the executed notebook, with its output
    assert (sources / "page.md").read_text(encoding="utf-8") == PAGE
    # A page without code is not a notebook and offers only its source.
    assert "ipynb" not in (project / "_build" / "html" / "index.html").read_text(encoding="utf-8")
