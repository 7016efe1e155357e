"""Every page's notebook runs off the site, in a fresh environment with only what the site ships.

The test does what the page "Run it yourself" tells a reader to do, with the built site served on
127.0.0.1: it downloads each page's notebook from the page's download menu and the files that
page links (the ``sdpa`` wheel, ``requirements.txt``, the archive), creates a virtual
environment, installs ``requirements.txt`` and the wheel (pip may use its cache), and runs every
notebook from top to bottom with ``jupyter execute``, two at a time.

It fails when a page with code offers no notebook; when a notebook's Markdown still holds MyST
(a ``{role}`` or a directive fence: ``{glue``, ``{ref``, ``{cite``, ``{numref``...); when its
code mentions ``myst_nb``; when it raises; when it shows fewer images, once run, than its page
has figures; when the environment holds anything but the wheel and the pinned packages; and when
the archive's files differ from the ones served one by one.

Build the site first (``make html``; ``make test`` does). Without a built site the tests skip,
except under ``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from pathlib import Path
from urllib.parse import urljoin

import pytest

pytestmark = [pytest.mark.site, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("SDPA_SITE_DIR", ROOT / "_build" / "html"))
REQUIRE = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"
RUN_PAGE = "run-it-yourself.html"
PARALLEL = 2  # notebooks run at once: the CI machine has 2 cores
TIMEOUT = 600  # seconds for one notebook on a busy machine (the book allows 180 per page)

# MyST left in a Markdown cell: a role (`{name}` then a backtick), a directive fence, or the
# start of the roles the book uses most, wherever they are.
MYST_ROLE = re.compile(r"\{[A-Za-z][\w:.+-]*\}`")
MYST_FENCE = re.compile(r"^\s*(```+|:::+)\s*\{", re.M)
MYST_WORDS = ("{glue", "{ref", "{cite", "{numref", "{doc}", "{eq}", "{func}", "{code-cell")
IMG = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]*_images/[^\"]+)\"", re.I)
NOTEBOOK_LINK = re.compile(r"href=\"([^\"]*_sources/[^\"]+\.ipynb)\"")


def _book_pages() -> dict[str, bool]:
    """The html page of each book source, and whether the source has code cells."""
    pages = {}
    for source in sorted((ROOT / "book").rglob("*.md")):
        if {"_static", "_templates", "_ext"} & set(source.relative_to(ROOT / "book").parts):
            continue
        page = source.relative_to(ROOT / "book").with_suffix(".html").as_posix()
        pages[page] = "```{code-cell}" in source.read_text(encoding="utf-8")
    return pages


BOOK_PAGES = _book_pages()
NOTEBOOK_PAGES = [page for page, has_code in BOOK_PAGES.items() if has_code]


def _skip_or_fail(reason: str) -> None:
    if REQUIRE:
        pytest.fail(reason)
    pytest.skip(reason)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def server():
    """Serve the site on 127.0.0.1 on a free port while this module runs."""
    if not (SITE / "index.html").exists():
        _skip_or_fail(f"the site is not built: no {SITE / 'index.html'}; run `make html` first")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.status == 200, f"{url}: HTTP {response.status}"
        return response.read()


def _article(html: str) -> str:
    """The page's own content (not the navigation, header or footer)."""
    start = html.find("<article")
    end = html.rfind("</article>")
    return html[start:end] if 0 <= start < end else html


def _env(tmp: Path) -> dict[str, str]:
    """The environment of a reader's shell: nothing of the book's build or this test's venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SDPA_", "JUPYTER", "PYTHON", "VIRTUAL_ENV", "MPL", "IPYTHON"))
    }
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
        (tmp / "home" / name).mkdir(parents=True, exist_ok=True)
        env[name] = str(tmp / "home" / name)
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    return env


def _run(command: list, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def reader(server, tmp_path_factory) -> dict:
    """Download everything over http, install it in a fresh venv and run every notebook."""
    tmp = tmp_path_factory.mktemp("reader")
    found: dict = {"pages": {}, "times": {}}
    started = time.perf_counter()

    # What each page offers: its notebook (from the download menu) and its figures.
    notebooks = tmp / "notebooks"
    for page in NOTEBOOK_PAGES:
        url = urljoin(server, page)
        html = _get(url).decode("utf-8")
        links = NOTEBOOK_LINK.findall(html)
        info = {"figures": len(IMG.findall(_article(html))), "link": links[0] if links else None}
        if links:
            data = _get(urljoin(url, links[0]))
            path = notebooks / page.removesuffix(".html")
            path = path.with_suffix(".ipynb")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            info["path"] = path
            info["raw"] = data
            info["downloaded"] = json.loads(data)
        found["pages"][page] = info

    # What "Run it yourself" links: the wheel, the requirements and the archive.
    run_url = urljoin(server, RUN_PAGE)
    run_html = _get(run_url).decode("utf-8")
    hrefs = set(re.findall(r"href=\"([^\"]*downloads/[^\"]+)\"", run_html))
    files = {}
    for href in sorted(hrefs):
        name = href.rsplit("/", 1)[-1]
        files[name] = _get(urljoin(run_url, href))
        (tmp / name).write_bytes(files[name])
    found["files"] = files
    found["times"]["download"] = time.perf_counter() - started

    wheels = [name for name in files if name.endswith(".whl")]
    assert len(wheels) == 1, f"{RUN_PAGE} should link one wheel; links {sorted(files)}"
    assert "requirements.txt" in files, f"{RUN_PAGE} links no requirements.txt; links {sorted(files)}"
    found["wheel"] = wheels[0]

    # The reader's commands: a virtual environment with the pinned requirements and the wheel.
    env = _env(tmp)
    venv = tmp / "venv"
    t0 = time.perf_counter()
    created = _run([sys.executable, "-m", "venv", venv], env, tmp, 300)
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    install = _run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "-r", "requirements.txt", found["wheel"]],
        env, tmp, 900,
    )  # fmt: skip
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"
    freeze = _run([python, "-m", "pip", "freeze", "--all", "--disable-pip-version-check"], env, tmp, 120)
    found["freeze"] = freeze.stdout
    found["times"]["install"] = time.perf_counter() - t0

    # Every notebook, top to bottom, two at a time, as `jupyter execute` runs it.
    def execute(page: str) -> tuple[str, subprocess.CompletedProcess, float]:
        t = time.perf_counter()
        path = found["pages"][page]["path"]
        result = _run(
            [venv / "bin" / "jupyter", "execute", "--inplace", f"--timeout={TIMEOUT}", path.name],
            env, path.parent, TIMEOUT + 120,
        )  # fmt: skip
        return page, result, time.perf_counter() - t

    t0 = time.perf_counter()
    runnable = [page for page, info in found["pages"].items() if "path" in info]
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        for page, result, seconds in pool.map(execute, runnable):
            info = found["pages"][page]
            info["result"], info["seconds"] = result, seconds
            if result.returncode == 0:
                info["executed"] = json.loads(info["path"].read_text(encoding="utf-8"))
    found["times"]["execute"] = time.perf_counter() - t0
    found["times"]["total"] = time.perf_counter() - started
    timings = {
        "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()},
        "seconds": found["times"],
        "notebooks": {p: round(i["seconds"], 1) for p, i in found["pages"].items() if "seconds" in i},
    }
    (SITE.parent / "notebooks-off-the-site.json").write_text(json.dumps(timings, indent=1) + "\n")
    return found


def _markdown(notebook: dict) -> list[str]:
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in notebook["cells"] if c["cell_type"] == "markdown"]  # fmt: skip


def _code(notebook: dict) -> list[str]:
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in notebook["cells"] if c["cell_type"] == "code"]  # fmt: skip


def _images(notebook: dict) -> int:
    return sum(
        any(mime.startswith("image/") for mime in output.get("data", {}))
        for cell in notebook["cells"]
        if cell["cell_type"] == "code"
        for output in cell.get("outputs", [])
    )


# Pages whose notebook cannot run off the site yet, and why. Strict: once one runs, the xfail
# fails, and its entry must go.
KNOWN_FAILURES = {
    "appendix/running.html": "its first hidden cell looks for the repository's Makefile",
}


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
    assert info["link"], f"{page} has code but its download menu offers no .ipynb"
    downloaded = info["downloaded"]

    problems = []
    for text in _markdown(downloaded):
        left = sorted(set(MYST_ROLE.findall(text) + MYST_FENCE.findall(text)))
        left += [word for word in MYST_WORDS if word in text]
        if left:
            problems.append(f"MyST left in a Markdown cell: {left} in {text[:120]!r}")
    for code in _code(downloaded):
        if re.search(r"\bmyst_nb\b", code):
            problems.append(f"a code cell uses myst_nb: {code[:120]!r}")

    result = info["result"]
    if result.returncode != 0:
        problems.append(f"jupyter execute failed:\n{result.stderr[-3000:]}")
    else:
        executed = info["executed"]
        errors = [o for c in executed["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
        if errors:
            problems.append(f"error outputs: {[e['ename'] + ': ' + e['evalue'] for e in errors]}")
        if _images(executed) < info["figures"]:
            problems.append(
                f"{_images(executed)} image outputs once run, but the page has {info['figures']} figures"
            )
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


def test_downloaded_notebooks_have_the_build_outputs(reader):
    """Before running, each notebook already shows the figures of its page (as the site does)."""
    short = {
        page: (_images(info["downloaded"]) + _attachments(info["downloaded"]), info["figures"])
        for page, info in reader["pages"].items()
        if "downloaded" in info
        and _images(info["downloaded"]) + _attachments(info["downloaded"]) < info["figures"]
    }
    assert not short, f"notebooks with fewer images than their page (images, figures): {short}"


def _attachments(notebook: dict) -> int:
    return sum(len(c.get("attachments", {}) or {}) for c in notebook["cells"] if c["cell_type"] == "markdown")


def test_environment_holds_only_the_wheel_and_the_pins(reader):
    """requirements.txt is complete: installing it with the wheel adds nothing unpinned."""
    pins = {
        line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
        for line in reader["files"]["requirements.txt"].decode().splitlines()
        if line and not line.startswith("#")
    }
    assert {"numpy", "matplotlib", "ipykernel", "nbclient"} <= set(pins), sorted(pins)
    installed = {}
    for line in reader["freeze"].splitlines():
        if "==" in line:
            name, version = line.split("==")
            installed[name.lower().replace("_", "-")] = version
    version = reader["wheel"].split("-")[1]
    assert installed.pop("sdpa") == version
    for tool in ("pip", "setuptools", "wheel"):  # the venv's own installer
        installed.pop(tool, None)
    assert installed == pins


def test_the_archive_holds_what_the_site_serves(reader):
    """One archive: every page's notebook, the wheel and requirements.txt, as served one by one."""
    archives = [name for name in reader["files"] if name.endswith(".zip")]
    assert len(archives) == 1, sorted(reader["files"])
    with zipfile.ZipFile(io.BytesIO(reader["files"][archives[0]])) as archive:
        folders = {name.split("/", 1)[0] for name in archive.namelist()}
        members = {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}
    assert folders == {archives[0].removesuffix(".zip")}  # one folder, as the page's commands say
    assert members.pop(reader["wheel"]) == reader["files"][reader["wheel"]]
    assert members.pop("requirements.txt") == reader["files"]["requirements.txt"]
    served = {
        page.removesuffix(".html") + ".ipynb": info["raw"]
        for page, info in reader["pages"].items()
        if "raw" in info
    }
    assert sorted(members) == sorted(served)
    assert all(members[name] == served[name] for name in members)
