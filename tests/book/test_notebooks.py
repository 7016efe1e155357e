"""Every page's notebook runs off the site, in a fresh environment with only what the site ships.

With the built site served on 127.0.0.1, the test downloads each page's notebook from the page's
download menu, and the files the page "Run it yourself" links (the archive, the ``sdpa`` wheel,
``requirements.txt``); then it follows that page's commands: unpack the archive, create a
virtual environment in its folder, ``pip install -r requirements.txt <wheel>`` (pip may use its
cache; ``--no-compile`` saves half the install's time), and run every notebook top to bottom with
``jupyter execute``, two at a time, the slowest first (the build's ``sdpa_slow_pages``). The
notebooks of the run share one folder of trained models (``SDPA_MODEL_CACHE``, empty at the start),
as one reader's would: the model of *Training a language model*, which four later pages study, is
trained once in the run instead of once in each.

It fails when a page with code offers no notebook; when a notebook's Markdown still holds MyST (a
``{role}`` or a directive fence: ``{glue``, ``{ref``, ``{cite``, ``{numref``...); when its code
uses ``myst_nb``; when it raises; when, once run, it shows fewer images than its page has
figures; when the environment holds anything besides the wheel and the pinned packages; and when
the archive's files differ from the ones served one by one. The timings of the run are written to
``_build/notebooks-off-the-site.json``.

Build the site first (``make html``; ``make test`` does). Without a built site the tests skip,
except under ``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.
"""

from __future__ import annotations

import ast
import concurrent.futures
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from urllib.parse import urljoin

import pytest
from site_server import serve

pytestmark = [pytest.mark.site, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("SDPA_SITE_DIR", ROOT / "_build" / "html"))
TIMINGS = SITE.parent / "notebooks-off-the-site.json"
REQUIRE = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"
RUN_PAGE = "run-it-yourself.html"
PARALLEL = 2  # notebooks run at once: the CI machine has 2 cores
TIMEOUT = 600  # seconds for one notebook on a busy machine (the build allows 180 per page)

# MyST left in a Markdown cell: a role (`{name}` and its backticked text), a directive fence, or
# the start of a role the book uses, outside maths and code (where braces are TeX or code).
MYST_ROLE = re.compile(r"(?<!`)\{([A-Za-z][\w:.+-]*)\}`[^`\n]*`")
MYST_FENCE = re.compile(r"^[ \t>]*(?:```+|:::+)[ \t]*\{[^}]*\}", re.M)
MYST_WORDS = (
    "{glue",
    "{ref",
    "{cite",
    "{numref",
    "{doc}",
    "{eq}",
    "{func}",
    "{class}",
    "{code-cell",
)
MATHS = re.compile(r"\$\$.*?\$\$|(?<!\\)\$[^$\n]+?(?<!\\)\$", re.S)
CODE = re.compile(r"`+[^`\n]*`+")
FIGURE = re.compile(r"<img\b[^>]*\bsrc=\"[^\"]*_images/", re.I)  # figures and plots of the page
NOTEBOOK_LINK = re.compile(r"href=\"([^\"]*_sources/[^\"]+\.ipynb)\"")
DOWNLOAD_LINK = re.compile(r"href=\"([^\"]*downloads/[^\"]+)\"")

# Pages whose notebook cannot run off the site yet, and why. Strict: once one runs, its xfail
# fails, and the entry must go.
KNOWN_FAILURES: dict[str, str] = {}


def _book_pages() -> list[str]:
    """The html page of each book source that has code cells (and so must be a notebook)."""
    pages = []
    for source in sorted((ROOT / "book").rglob("*.md")):
        if {"_static", "_ext"} & set(source.relative_to(ROOT / "book").parts):
            continue
        if "```{code-cell}" in source.read_text(encoding="utf-8"):
            pages.append(source.relative_to(ROOT / "book").with_suffix(".html").as_posix())
    return pages


NOTEBOOK_PAGES = _book_pages()


def _slow_pages() -> list[str]:
    """The html pages of the build's ``sdpa_slow_pages`` (conf.py), in their order."""
    for node in ast.parse((ROOT / "conf.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "sdpa_slow_pages":
            return [f"{name}.html" for name in ast.literal_eval(node.value)]
    raise AssertionError("conf.py sets no sdpa_slow_pages")


def _slowest_first(pages: list[str]) -> list[str]:
    slow = [page for page in _slow_pages() if page in pages]
    return slow + [page for page in pages if page not in slow]


def _skip_or_fail(reason: str) -> None:
    if REQUIRE:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def server():
    """Serve the site on 127.0.0.1 on a free port while this module runs."""
    if not (SITE / "index.html").exists():
        _skip_or_fail(f"the site is not built: no {SITE / 'index.html'}; run `make html` first")
    with serve(SITE) as base:
        yield f"{base}/"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


def _article(html: str) -> str:
    """The page's own content, without the navigation, header and footer."""
    start, end = html.find("<article"), html.rfind("</article>")
    return html[start:end] if 0 <= start < end else html


def _reader_env(tmp: Path) -> dict[str, str]:
    """A reader's shell: nothing of the book's build or of this test's environment."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SDPA_", "JUPYTER", "PYTHON", "VIRTUAL_ENV", "MPL", "IPYTHON"))
    }
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR",
                 "MPLCONFIGDIR"):  # fmt: skip
        env[name] = str(tmp / "home" / name)
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # the debugger's warning about frozen modules
    return env


def _run(command: list, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def reader(server, tmp_path_factory) -> dict:
    """Download everything over http, install it in a fresh venv and run every notebook."""
    tmp = tmp_path_factory.mktemp("reader")
    found: dict = {"pages": {}, "seconds": {}}
    started = time.perf_counter()

    # Each page: its notebook, from the download menu, and its figures.
    for page in NOTEBOOK_PAGES:
        html = _get(urljoin(server, page)).decode("utf-8")
        links = NOTEBOOK_LINK.findall(html)
        info = found["pages"][page] = {"figures": len(FIGURE.findall(_article(html)))}
        if links:
            info["raw"] = _get(urljoin(urljoin(server, page), links[0]))
            info["downloaded"] = json.loads(info["raw"])

    # "Run it yourself": the archive, the wheel and the requirements it links.
    run_url = urljoin(server, RUN_PAGE)
    files = found["files"] = {
        href.rsplit("/", 1)[-1]: _get(urljoin(run_url, href))
        for href in sorted(set(DOWNLOAD_LINK.findall(_get(run_url).decode("utf-8"))))
    }
    found["seconds"]["download"] = time.perf_counter() - started
    wheels = [name for name in files if name.endswith(".whl")]
    archives = [name for name in files if name.endswith(".zip")]
    assert len(wheels) == 1 and len(archives) == 1 and "requirements.txt" in files, (
        f"{RUN_PAGE} should link one wheel, one archive and requirements.txt; it links {sorted(files)}"
    )
    found["wheel"], found["archive"] = wheels[0], archives[0]

    # The page's commands: unpack, a virtual environment in the folder, pip install.
    t0 = time.perf_counter()
    with zipfile.ZipFile(io.BytesIO(files[found["archive"]])) as archive:
        archive.extractall(tmp)
    folder = tmp / found["archive"].removesuffix(".zip")
    env = _reader_env(tmp)
    env["SDPA_MODEL_CACHE"] = str(tmp / "models")  # shared by this run's notebooks, empty now
    created = _run([sys.executable, "-m", "venv", ".venv"], env, folder, 300)
    assert created.returncode == 0, created.stderr
    bin_dir = folder / ".venv" / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    pip = [bin_dir / "python", "-m", "pip", "--disable-pip-version-check"]
    # --no-compile: the one change to the page's command; pip's byte-compiling of every module
    # of every package is most of the install's time, and the kernels compile what they import.
    install = _run(
        [*pip, "install", "--quiet", "--no-compile", "-r", "requirements.txt", found["wheel"]],
        env, folder, 900,
    )  # fmt: skip
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"
    found["freeze"] = _run([*pip, "freeze", "--all"], env, folder, 120).stdout
    found["seconds"]["install"] = time.perf_counter() - t0

    # Every notebook, top to bottom, two at a time.
    def execute(page: str) -> tuple[str, subprocess.CompletedProcess, float]:
        t = time.perf_counter()
        path = folder / page.replace(".html", ".ipynb")
        result = _run(
            [bin_dir / "jupyter", "execute", "--inplace", f"--timeout={TIMEOUT}", path.name],
            env, path.parent, TIMEOUT + 120,
        )  # fmt: skip
        return page, result, time.perf_counter() - t

    t0 = time.perf_counter()
    runnable = [
        page
        for page in _slowest_first(NOTEBOOK_PAGES)
        if (folder / page.replace(".html", ".ipynb")).exists()
    ]
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        for page, result, seconds in pool.map(execute, runnable):
            info = found["pages"][page]
            info["result"], info["seconds"] = result, seconds
            if result.returncode == 0:
                info["executed"] = json.loads(
                    (folder / page.replace(".html", ".ipynb")).read_text()
                )
    found["seconds"]["execute"] = time.perf_counter() - t0
    found["seconds"]["total"] = time.perf_counter() - started
    found["folder"] = folder
    TIMINGS.write_text(
        json.dumps(
            {
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "seconds": {k: round(v, 1) for k, v in found["seconds"].items()},
                "notebooks": {
                    p: round(i["seconds"], 1) for p, i in found["pages"].items() if "seconds" in i
                },
            },
            indent=1,
        )
        + "\n"
    )
    return found


def myst_left(text: str) -> list[str]:
    """The MyST a Markdown text still holds: roles, directive fences, role names."""
    text = MATHS.sub(" ", text)
    left = [f"{{{name}}}" for name in MYST_ROLE.findall(text)] + MYST_FENCE.findall(text)
    text = CODE.sub(" ", MYST_ROLE.sub(" ", text))
    return sorted(set(left + [word for word in MYST_WORDS if word in text]))


def test_the_slowest_notebooks_run_first():
    assert _slow_pages()[:2] == ["lm/training.html", "lm/induction-heads.html"]
    assert set(_slow_pages()) <= set(NOTEBOOK_PAGES)
    assert _slowest_first(["a.html", "lm/induction-heads.html", "b.html"]) == [
        "lm/induction-heads.html",
        "a.html",
        "b.html",
    ]


def test_myst_left_finds_roles_and_directives_but_not_tex_or_code():
    text = (
        "A {glue:text}`x:.3f` and {ref}`sec`, `{cite:p}` as code, $\\text{ref}$ and\n"
        "$$\n\\frac{a}{b}\n$$\n:::{glue:figure} fig\n:::\n> ```{note}\nand {numref"
    )
    assert myst_left(text) == [
        ":::{glue:figure}",
        "> ```{note}",
        "{glue",
        "{glue:text}",
        "{numref",
        "{ref}",
    ]
    assert myst_left('Plain $\\operatorname{softmax}(s)$ and `glue("x", {})`.') == []


def _sources(notebook: dict, kind: str) -> list[str]:
    return ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == kind]


def _images(notebook: dict) -> int:
    return sum(
        any(mime.startswith("image/") for mime in output.get("data", {}))
        for cell in notebook["cells"]
        if cell["cell_type"] == "code"
        for output in cell.get("outputs", [])
    )


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.xfail(reason=KNOWN_FAILURES[page], strict=True))
        if page in KNOWN_FAILURES
        else page
        for page in NOTEBOOK_PAGES
    ]
    or ["(no book pages)"],
)
def test_notebook_runs_off_the_site(page, reader):
    info = reader["pages"][page]
    assert "downloaded" in info, f"{page} has code but its download menu offers no .ipynb"
    problems = []
    for text in _sources(info["downloaded"], "markdown"):
        if left := myst_left(text):
            problems.append(f"MyST left in a Markdown cell: {left} in {text[:160]!r}")
    problems += [
        f"a code cell uses myst_nb: {code[:160]!r}"
        for code in _sources(info["downloaded"], "code")
        if re.search(r"\bmyst_nb\b", code)
    ]
    result = info.get("result")
    if result is None:
        problems.append("the archive has no notebook for this page")
    elif result.returncode != 0:
        problems.append(f"jupyter execute failed:\n{result.stderr[-3000:]}")
    elif _images(info["executed"]) < info["figures"]:
        problems.append(
            f"{_images(info['executed'])} images once run, but the page has {info['figures']} figures"
        )
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


def test_downloaded_notebooks_show_the_pages_figures(reader):
    """Before anything runs, a notebook shows as many images as its page (outputs or in the text)."""
    short = {}
    for page, info in reader["pages"].items():
        if "downloaded" in info:
            notebook = info["downloaded"]
            attached = sum(len(c.get("attachments") or {}) for c in notebook["cells"])
            if _images(notebook) + attached < info["figures"]:
                short[page] = (_images(notebook) + attached, info["figures"])
    assert not short, f"notebooks with fewer images than their page (images, figures): {short}"


def test_environment_holds_only_the_wheel_and_the_pins(reader):
    """requirements.txt is complete: installing it with the wheel adds nothing unpinned."""

    def parse(lines: str) -> dict[str, str]:
        """name -> version, or -> URL for a package installed from a file (``name @ URL``)."""
        found = {}
        for line in lines.splitlines():
            name, sep, version = line.partition(" @ ") if " @ " in line else line.partition("==")
            if sep and not line.startswith("#"):
                found[name.strip().lower().replace("_", "-")] = version.strip()
        return found

    pins = parse(reader["files"]["requirements.txt"].decode())
    assert {"numpy", "matplotlib", "ipykernel", "nbclient"} <= set(pins), sorted(pins)
    installed = parse(reader["freeze"])
    url, _, digest = installed.pop("sdpa").partition("#sha256=")  # the wheel from the site
    assert url.endswith("/" + reader["wheel"])
    assert digest == hashlib.sha256(reader["files"][reader["wheel"]]).hexdigest()
    for tool in ("pip", "setuptools", "wheel"):  # the virtual environment's own installer
        installed.pop(tool, None)
    assert installed == pins


def test_the_archive_holds_what_the_site_serves(reader):
    """One archive: every page's notebook, the wheel and requirements.txt, as served one by one."""
    with zipfile.ZipFile(io.BytesIO(reader["files"][reader["archive"]])) as archive:
        folders = {name.split("/", 1)[0] for name in archive.namelist()}
        members = {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}
    assert folders == {reader["archive"].removesuffix(".zip")}  # one folder, as the commands say
    assert members.pop(reader["wheel"]) == reader["files"][reader["wheel"]]
    assert members.pop("requirements.txt") == reader["files"]["requirements.txt"]
    served = {
        page.replace(".html", ".ipynb"): info["raw"]
        for page, info in reader["pages"].items()
        if "raw" in info
    }
    assert sorted(members) == sorted(served)
    assert [name for name in members if members[name] != served[name]] == []
