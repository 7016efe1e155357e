"""The source archive the site serves is the whole project: unpacked in a fresh folder, it builds.

*Running the code* links the source archive (the sdist, ``MANIFEST.in``) and says that ``make html``
and ``make test`` work in the unpacked folder. With the built site served on 127.0.0.1, these
tests download the archive from that page's link and check

* its files: those git tracks (and new files git would track), the Makefile, ``conf.py``, the book,
  the tests and the lock files among them; no build output (``_build``, ``.venv``,
  ``node_modules``, caches); the wheel beside it holds the packages only;
* that it builds: unpacked in a fresh temporary folder (no ``.git``), ``make html`` builds the
  site, its downloads included, and the source archive it serves has the same files; a test file
  of the unpacked ``tests/`` passes there.

The unpacked build starts from a copy of this build's execution cache, less the pages whose code
reads the project's files (``FRESH_PAGES``): those execute in the unpacked folder, the others'
outputs are taken from the cache, which also checks that the cache's key (a fingerprint of the
sources and versions) does not depend on where the project lives. Executing every page again
would prove nothing more: the archive's files are git's (checked here), and ``make test`` has just
executed every page of those files afresh (``make html-force``); it cost five minutes of a CI run.

The unpacked folder gets its own ``.venv``, in which ``sdpa`` is installed (editable) from the
unpacked ``src/``; the other packages come from this test's environment, which a ``.pth`` file puts
on its path, instead of being downloaded again (``make venv`` would install the same pins from
``constraints.txt``). Nothing is installed into this test's environment: the test checks that its
``site-packages`` is unchanged. MathJax comes from the Makefile's own ``npm ci``, from npm's cache
when it has the packages. The timings are written to ``<builddir>/source-archive.json``.

Build the site first (``make html``; ``make test`` does). Without a built site the tests skip,
except under ``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin

import pytest
from site_server import serve

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("SDPA_SITE_DIR", ROOT / "_build" / "html"))
TIMINGS = SITE.parent / "source-archive.json"
BUILD_CACHE = SITE.parent / "doctrees" / "jupyter-cache"  # the execution caches of `make html`
REQUIRE = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
RUNNING_PAGE = "appendix/running.html"
ARCHIVE = f"sdpa-{VERSION}.tar.gz"
WHEEL = f"sdpa-{VERSION}-py3-none-any.whl"
ARCHIVE_LINK = re.compile(r'href="([^"]*downloads/' + re.escape(ARCHIVE) + ')"')
BUILD_TIMEOUT = 1800  # seconds for `make html` in the unpacked folder (about a minute idle)

# What setuptools adds to an sdist: the project has none of it.
SDIST_METADATA = re.compile(r"^(PKG-INFO|setup\.cfg|src/[^/]+\.egg-info/.*)$")
# What must never be in the archive: build output, environments, caches.
BUILD_OUTPUT = (
    ".git",
    ".venv",
    "_build",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
    ".ipynb_checkpoints",
)
# What `make html` and `make test` need, and the page that tells the reader to run them.
NEEDED = [
    "Makefile",
    "MANIFEST.in",
    "conf.py",
    "pyproject.toml",
    "constraints.txt",
    "package.json",
    "package-lock.json",
    ".ci/run",
    "book/index.md",
    "book/appendix/running.md",
    "book/_ext/sdpa_downloads.py",
    "benchmarks/results/latest.json",
    "src/sdpa/__init__.py",
    "src/sdpa_book/__init__.py",
    "tests/conftest.py",
    "tests/book/test_source_archive.py",
]
# A test file of the archive, run in the unpacked folder against the unpacked package.
UNPACKED_TEST = "tests/sdpa/test_softmax_stable.py"
# Pages whose code reads the project's files (the Makefile, MANIFEST.in, the benchmark results, the
# pages' own sources): the unpacked build executes them afresh; the others come from the cache.
READS_FILES = re.compile(r"read_text\(|\bopen\(|json\.loads?\(|np\.load\(")
FRESH_PAGES = sorted(
    p.relative_to(ROOT / "book").with_suffix("").as_posix()
    for p in (ROOT / "book").rglob("*.md")
    if "```{code-cell}" in (text := p.read_text(encoding="utf-8")) and READS_FILES.search(text)
)


def _skip_or_fail(reason: str) -> None:
    if REQUIRE:
        pytest.fail(reason)
    pytest.skip(reason)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


@pytest.fixture(scope="module")
def served() -> dict[str, bytes]:
    """The source archive and the wheel, downloaded from the links of *Running the code*."""
    if not (SITE / "index.html").exists():
        _skip_or_fail(f"the site is not built: no {SITE / 'index.html'}; run `make html` first")
    with serve(SITE) as base:
        page = urljoin(f"{base}/", RUNNING_PAGE)
        links = sorted(set(ARCHIVE_LINK.findall(_get(page).decode("utf-8"))))
        assert links, f"{RUNNING_PAGE} does not link the source archive {ARCHIVE}"
        archive = _get(urljoin(page, links[0]))
        wheel = _get(urljoin(page, links[0].replace(ARCHIVE, WHEEL)))
    return {ARCHIVE: archive, WHEEL: wheel}


def _members(archive: bytes) -> dict[str, tarfile.TarInfo]:
    """The archive's entries by path inside its one top folder, ``sdpa-<version>/``."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        entries = tar.getmembers()
    tops = {entry.name.split("/", 1)[0] for entry in entries}
    assert tops == {f"sdpa-{VERSION}"}, f"the archive should unpack into one folder; it has {tops}"
    return {entry.name.partition("/")[2]: entry for entry in entries if entry.isfile()}


def _project_files(members: dict[str, tarfile.TarInfo]) -> set[str]:
    return {name for name in members if not SDIST_METADATA.match(name)}


def _git_files() -> set[str] | None:
    """The files git tracks, and the new ones it would track; None without git or .git."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    return {name for name in listed.split("\0") if name and (ROOT / name).is_file()}


@pytest.mark.site
@pytest.mark.slow
def test_the_archive_holds_the_project(served):
    members = _members(served[ARCHIVE])
    names = _project_files(members)
    built = sorted(
        n for n in members if set(n.split("/")) & set(BUILD_OUTPUT) or n.endswith(".pyc")
    )
    assert not built, f"build output in the source archive: {built[:10]}"
    missing = [name for name in NEEDED if name not in names]
    assert not missing, f"the source archive lacks {missing}: `make html` needs them (MANIFEST.in)"
    assert members[".ci/run"].mode & 0o111, ".ci/run lost its executable bit"
    tracked = _git_files()
    if tracked is None:
        pytest.skip("no git repository here: the archive's files cannot be compared with git's")
    assert sorted(names - tracked) == [], "files in the archive that git does not track"
    assert sorted(tracked - names) == [], (
        "files git tracks that the archive lacks (add them to MANIFEST.in, or rebuild the site)"
    )


@pytest.mark.site
@pytest.mark.slow
def test_the_wheel_holds_the_packages_only(served):
    with zipfile.ZipFile(io.BytesIO(served[WHEEL])) as wheel:
        names = wheel.namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"sdpa", "sdpa_book", f"sdpa-{VERSION}.dist-info"}, tops
    assert all(n.endswith(".py") for n in names if not n.startswith(f"sdpa-{VERSION}.dist-info"))


def _tiny_dist(tmp_path: Path, sdist_files: list[str]) -> tuple[Path, Path, Path]:
    """A project with two one-line packages, its wheel, and an sdist holding ``sdist_files``."""
    root = tmp_path / "project"
    for name in ["src/sdpa/__init__.py", "src/sdpa_book/__init__.py", *sdist_files]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")
    wheel, sdist = tmp_path / WHEEL, tmp_path / ARCHIVE
    with zipfile.ZipFile(wheel, "w") as archive:
        for package in ("sdpa", "sdpa_book"):
            archive.write(root / "src" / package / "__init__.py", f"{package}/__init__.py")
    with tarfile.open(sdist, "w:gz") as archive:
        for name in sdist_files:
            archive.add(root / name, f"sdpa-{VERSION}/{name}")
    return wheel, sdist, root


def test_the_build_refuses_a_source_archive_without_the_project(tmp_path):
    """book/_ext/sdpa_downloads.py fails the build when the sdist is the package alone."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        from sdpa_downloads import SOURCE_TREE, dist_problem
    finally:
        sys.path.remove(str(ROOT / "book" / "_ext"))
    package_only = ["pyproject.toml", "src/sdpa/__init__.py", "src/sdpa_book/__init__.py"]
    wheel, sdist, root = _tiny_dist(tmp_path / "package", package_only)
    assert dist_problem(wheel, sdist, root) == (
        "a source archive without Makefile, conf.py, constraints.txt (see MANIFEST.in)"
    )
    wheel, sdist, root = _tiny_dist(tmp_path / "whole", sorted({*package_only, *SOURCE_TREE}))
    assert dist_problem(wheel, sdist, root) is None


# ---------------------------------------------------------------------------------------------
# The unpacked archive builds the book


def _clean_env(folder: Path) -> dict[str, str]:
    """A shell in the unpacked folder: its .venv first on PATH, nothing of this test's setup."""
    own_bin = str(Path(sys.prefix) / "bin")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SDPA_", "PYTHON", "VIRTUAL_ENV", "JUPYTER", "MPL", "IPYTHON"))
        and key not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    }
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != own_bin]
    env["PATH"] = os.pathsep.join([str(folder / ".venv" / "bin"), *path])
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    return env


def _run(command: list, folder: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(result: subprocess.CompletedProcess, what: str) -> None:
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"{what} failed ({result.returncode}):\n{output}"


def _own_venv(folder: Path, env: dict) -> None:
    """The folder's .venv: sdpa from the folder's src/, the rest from this test's environment."""
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", ".venv"], folder, env, 300), "venv")
    python = folder / ".venv" / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   folder, env, 60).stdout.strip()  # fmt: skip
    # A directory named in a .pth file joins sys.path, but its own .pth files are not read, so
    # this environment's editable sdpa (a .pth file naming the repository's src/) stays out.
    site_dirs = [p for p in sys.path if Path(p).name in {"site-packages", "dist-packages"}]
    Path(purelib, "_sdpa_test_environment.pth").write_text("".join(f"{p}\n" for p in site_dirs))
    install = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
               "--no-index", "--no-compile", "-e", "."]  # fmt: skip
    _ok(_run(install, folder, env, 600), "pip install -e . in the unpacked folder")
    (folder / ".venv" / ".installed").touch()  # the Makefile's stamp: the environment is ready


def _site_packages_state() -> dict[str, float | None]:
    """What an install into this test's site-packages would change: every entry's name, each
    file's modification time (.pth files: where an editable install points) and each
    distribution's RECORD's. A package folder's own time is left out: it changes whenever
    Python first writes a module's bytecode there, which a fresh environment does during a run.
    """
    root = Path(sysconfig.get_paths()["purelib"])
    state: dict[str, float | None] = {}
    for entry in root.iterdir():
        record = entry / "RECORD"
        if entry.is_file():
            state[entry.name] = entry.stat().st_mtime
        elif entry.name.endswith(".dist-info") and record.exists():
            state[entry.name] = record.stat().st_mtime
        else:
            state[entry.name] = None
    return state


def _page(uri: str) -> str:
    """The page (``part/name``) of a cache record's source path ``.../book/part/name.md``."""
    return uri.replace(os.sep, "/").rpartition("/book/")[2].removesuffix(".md")


def _seed_execution_cache(folder: Path) -> tuple[str, set[str]]:
    """Copy this build's current execution cache into the unpacked folder, less the records of
    ``FRESH_PAGES``; its folder name and the hash keys of the records kept."""
    from jupyter_cache import get_cache

    caches = sorted(BUILD_CACHE.glob("sdpa-*"), key=lambda p: p.stat().st_mtime)
    if not caches:
        _skip_or_fail(f"no execution cache in {BUILD_CACHE}: build the site with `make html`")
    target = folder / "_build" / "doctrees" / "jupyter-cache" / caches[-1].name
    shutil.copytree(caches[-1], target)
    cache = get_cache(target)
    for record in cache.list_cache_records():
        if _page(record.uri) in FRESH_PAGES:
            cache.remove_cache(record.pk)
    return target.name, {record.hashkey for record in cache.list_cache_records()}


def _build_unpacked(archive: bytes, tmp: Path) -> dict:
    """Unpack ``archive`` into ``tmp``, give it a .venv and this build's execution cache (less
    ``FRESH_PAGES``), run `make html` and one test file."""
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp, filter="data")
    folder = tmp / f"sdpa-{VERSION}"
    env = _clean_env(folder)
    _own_venv(folder, env)
    seeded = _seed_execution_cache(folder)
    seconds["unpack, venv and cache"] = time.perf_counter() - t0
    probe = ("import sdpa, sdpa_book, jupyter_client.kernelspec as ks; "
             "print(sdpa.__file__); print(sdpa_book.__file__); "
             "print(ks.KernelSpecManager().get_kernel_spec('python3').argv[0])")  # fmt: skip
    imported = _run([folder / ".venv" / "bin" / "python", "-c", probe], folder, env, 120)
    _ok(imported, "importing sdpa in the unpacked folder's .venv")

    t0 = time.perf_counter()
    # --prefer-offline: npm's cache serves the pinned MathJax when it has it, else the registry.
    # The reader's command, with the pages read (and executed) two at a time: this build runs
    # beside the other tests of `make test`, and the two cores have room for it.
    make = _run(
        ["make", "html", "NPM=npm --prefer-offline", "SPHINXOPTS=-n -W --keep-going -j 2"],
        folder,
        env,
        BUILD_TIMEOUT,
    )
    seconds["make html"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # Its own temporary folder: pytest prunes the oldest of /tmp/pytest-of-<user>/, this run's too.
    pytest_run = _run(
        [folder / ".venv" / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--basetemp={folder / '_build' / 'pytest'}", UNPACKED_TEST], folder, env, 600,
    )  # fmt: skip
    seconds["pytest " + UNPACKED_TEST] = time.perf_counter() - t0
    TIMINGS.write_text(json.dumps({"seconds": seconds}, indent=1) + "\n")
    return {"folder": folder, "imported": imported.stdout.split(), "make": make,
            "pytest": pytest_run, "seeded": seeded}  # fmt: skip


@pytest.fixture(scope="module")
def unpacked_build(served) -> Iterator[dict]:
    """The served archive, unpacked in a fresh folder and built there (removed afterwards).

    The folder is not under pytest's tmp_path: pytest sessions started meanwhile (the one in
    the folder, or others on the machine) prune the oldest of those, and the build takes minutes.
    """
    if shutil.which("make") is None or shutil.which("npm") is None:
        _skip_or_fail("building the unpacked archive needs make and npm")
    before = _site_packages_state()
    with tempfile.TemporaryDirectory(prefix="sdpa-source-archive-") as tmp:
        built = _build_unpacked(served[ARCHIVE], Path(tmp))
        built["site_packages_unchanged"] = _site_packages_state() == before
        yield built


@pytest.mark.site
@pytest.mark.slow
def test_the_unpacked_folder_uses_its_own_sources(unpacked_build):
    folder = unpacked_build["folder"]
    assert not (folder / ".git").exists()
    sdpa_file, sdpa_book_file, kernel_python = unpacked_build["imported"]
    assert Path(sdpa_file).is_relative_to(folder / "src"), sdpa_file
    assert Path(sdpa_book_file).is_relative_to(folder / "src"), sdpa_book_file
    assert Path(kernel_python).is_relative_to(folder / ".venv"), kernel_python  # pages' kernels
    assert unpacked_build["site_packages_unchanged"], "the test changed its own site-packages"


@pytest.mark.site
@pytest.mark.slow
def test_make_html_builds_the_book_from_the_unpacked_archive(served, unpacked_build):
    folder = unpacked_build["folder"]
    _ok(unpacked_build["make"], "make html in the unpacked archive")
    site = folder / "_build" / "html"
    assert (site / "index.html").exists() and (site / RUNNING_PAGE).exists()
    # Every page with code has its outputs: FRESH_PAGES executed in the unpacked folder, the
    # others came from the seeded cache, found under the same key (nothing else executed).
    pages = [p for p in (folder / "book").rglob("*.md") if "```{code-cell}" in p.read_text()]
    name, kept = unpacked_build["seeded"]
    root = folder / "_build" / "doctrees" / "jupyter-cache"
    caches = sorted(p.name for p in root.iterdir())
    assert caches == [name], f"the unpacked build keyed its execution cache apart: {caches}"
    with sqlite3.connect(root / name / "global.db") as db:
        records = db.execute("select hashkey, uri from nbcache").fetchall()
    assert len(records) == len(pages), f"{len(records)} of {len(pages)} pages have their outputs"
    executed = sorted(_page(uri) for key, uri in records if key not in kept)
    assert executed == FRESH_PAGES, f"executed in the unpacked folder: {executed}"
    # The archive it serves in turn holds the same files.
    rebuilt = (site / "downloads" / ARCHIVE).read_bytes()
    assert _project_files(_members(rebuilt)) == _project_files(_members(served[ARCHIVE]))


@pytest.mark.site
@pytest.mark.slow
def test_the_unpacked_tests_run(unpacked_build):
    _ok(unpacked_build["pytest"], f"pytest {UNPACKED_TEST} in the unpacked archive")
    assert re.search(r"\b\d+ passed\b", unpacked_build["pytest"].stdout)
