"""The package in the site: the ``sdpa`` wheel and source archive, requirements, every notebook.

``make html`` builds the wheel and the source archive into ``<builddir>/dist`` (``sdpa_dist_dir``)
before Sphinx runs. The wheel holds the packages of ``src/``; the source archive (the sdist, see
``MANIFEST.in``) is the whole project, from which ``make html`` and ``make test`` work. Once the
site is built, this extension copies them into the site's ``downloads/`` with a
``requirements.txt`` pinned to the versions the book was built with, and one archive holding
every reader's notebook (written by ``sdpa_notebooks``), the wheel and the requirements. A wheel
that lacks a file of ``src/`` or holds an older one is refused with a warning (the build then
fails), and so is a source archive that lacks a file of ``SOURCE_TREE``; the Makefile rebuilds
both when a file that goes into them changes. The download menu of every page links the archive
and the page "Run it yourself".

A project without a version in ``pyproject.toml`` (the build tests' tiny books) has no downloads.
"""

from __future__ import annotations

import shutil
import tarfile
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from sdpa_notebooks import RUN_PAGE, built_with, is_notebook, reader_notebook_path
from sphinx.util import logging

logger = logging.getLogger(__name__)

DOWNLOADS = "downloads"  # the site's folder for the wheel, sdist, requirements and archive
# What a reader's environment needs besides the wheel's own dependencies.
READER_PACKAGES = ["numpy", "matplotlib", "ipykernel", "nbclient"]
ZIP_DATE = (2026, 1, 1, 0, 0, 0)  # fixed, so that an unchanged book gives the same archive
# Files the source archive needs so that `make html` and `make test` run from it (a sample:
# tests/book/test_source_archive.py checks the whole list against the files git tracks).
SOURCE_TREE = [
    "Makefile",
    "conf.py",
    "pyproject.toml",
    "constraints.txt",
    "package.json",
    "package-lock.json",
    "book/index.md",
    "book/_ext/sdpa_downloads.py",
    "src/sdpa/__init__.py",
    "tests/conftest.py",
]


def _package_version(app) -> str | None:
    """The version in pyproject.toml; None for a project without one (the build tests' books)."""
    pyproject = Path(app.confdir) / "pyproject.toml"
    if not pyproject.exists():
        return None
    return tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("version")


def _archive_name(app) -> str | None:
    version = _package_version(app)
    return f"sdpa-{version}-notebooks.zip" if version else None


def pinned_requirements(roots: list[str]) -> list[str]:
    """``name==version`` for the packages ``roots`` and all they need, as installed here."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    environment = {**default_environment(), "extra": ""}
    pins: dict[str, str] = {}
    todo = [Requirement(root) for root in roots]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in pins:
            continue
        pins[name] = metadata.version(requirement.name)
        for line in metadata.requires(requirement.name) or []:
            dependency = Requirement(line)
            if dependency.marker is None or dependency.marker.evaluate(environment):
                todo.append(dependency)
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def requirements_text(wheel: str) -> str:
    """The notebooks' requirements, pinned as the book was built, and how to install them."""
    from packaging.requirements import Requirement

    own = [line for line in metadata.requires("sdpa") or [] if Requirement(line).marker is None]
    pins = [
        pin for pin in pinned_requirements(READER_PACKAGES + own) if not pin.startswith("sdpa==")
    ]
    return "\n".join([
        f"# What the sdpa book's notebooks need, as the book was built ({built_with()}).",
        f"#   python -m pip install -r requirements.txt {wheel}",
        *pins,
    ]) + "\n"  # fmt: skip


def stale_files(wheel: Path, src: Path) -> list[str]:
    """The package files under ``src`` that the wheel lacks or holds in another version."""
    with zipfile.ZipFile(wheel) as archive:
        inside = {name: archive.read(name) for name in archive.namelist() if name.endswith(".py")}
    stale = []
    for package in ("sdpa", "sdpa_book"):
        for path in sorted((src / package).rglob("*.py")):
            name = path.relative_to(src).as_posix()
            if inside.get(name) != path.read_bytes():
                stale.append(name)
    return stale


def missing_sources(sdist: Path) -> list[str]:
    """The files of ``SOURCE_TREE`` that the source archive lacks."""
    with tarfile.open(sdist) as archive:
        inside = {member.name.partition("/")[2] for member in archive.getmembers()}
    return [name for name in SOURCE_TREE if name not in inside]


def dist_problem(wheel: Path, sdist: Path, root: Path) -> str | None:
    """What is wrong with the wheel and source archive of the project in ``root``, if anything."""
    missing = [path.name for path in (wheel, sdist) if not path.exists()]
    if missing:
        return f"no {' and no '.join(missing)}"
    stale = stale_files(wheel, root / "src")
    if stale:
        return f"a wheel with an older {', '.join(stale[:3])}"
    lacking = missing_sources(sdist)
    if lacking:
        return f"a source archive without {', '.join(lacking[:3])} (see MANIFEST.in)"
    return None


def _zip(path: Path, files: dict[str, bytes]) -> None:
    partial = path.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, files[name])
    partial.replace(path)


def write_downloads(app, exception) -> None:
    """Copy the wheel and sdist, write the requirements and the archive (build-finished)."""
    if exception or app.builder.format != "html":
        return
    version = _package_version(app)
    if version is None:
        return
    dist = Path(app.config.sdpa_dist_dir or Path(app.outdir).parent / "dist")
    wheel, sdist = dist / f"sdpa-{version}-py3-none-any.whl", dist / f"sdpa-{version}.tar.gz"
    problem = dist_problem(wheel, sdist, Path(app.confdir))
    if problem:
        logger.warning(
            "the site's downloads need the sdpa wheel and source archive of this project, but "
            "%s has %s: run `make html`, which builds them", dist, problem, type="sdpa",
            subtype="dist",
        )  # fmt: skip
        return
    downloads = Path(app.outdir) / DOWNLOADS
    shutil.rmtree(downloads, ignore_errors=True)
    downloads.mkdir(parents=True)
    for path in (wheel, sdist):
        shutil.copy2(path, downloads / path.name)
    requirements = requirements_text(wheel.name).encode("utf-8")
    (downloads / "requirements.txt").write_bytes(requirements)
    folder = f"sdpa-{version}-notebooks"
    files = {
        f"{folder}/{docname}.ipynb": reader_notebook_path(app, docname).read_bytes()
        for docname in sorted(app.env.found_docs)
        if is_notebook(app, docname)
    }
    files[f"{folder}/requirements.txt"] = requirements
    files[f"{folder}/{wheel.name}"] = wheel.read_bytes()
    _zip(downloads / _archive_name(app), files)
    logger.info(
        "sdpa_downloads: the wheel, the sdist and %d notebooks in one archive", len(files) - 2
    )


def link_run_page(app, pagename, templatename, context, doctree) -> None:
    """Add the archive and "Run it yourself" to the download menu (after the theme fills it)."""
    if RUN_PAGE not in app.env.found_docs:
        return
    pathto = context["pathto"]
    archive = _archive_name(app)
    for group in context.get("header_buttons", []):
        if group.get("label") != "download-buttons":
            continue
        if archive is not None:
            group["buttons"].insert(
                1 if context.get("ipynb_source") else 0,
                {
                    "type": "link",
                    "url": pathto(f"{DOWNLOADS}/{archive}", 1),
                    "text": "all notebooks",
                    "tooltip": "Every page's notebook, the sdpa wheel and requirements.txt (.zip)",
                    "icon": "fas fa-file-zipper",
                    "label": "download-archive-button",
                },
            )
        group["buttons"].append(
            {
                "type": "link",
                "url": pathto(RUN_PAGE),
                "text": "Run it yourself",
                "tooltip": "How to install sdpa from this site and run the notebooks",
                "icon": "fas fa-play",
                "label": "run-it-yourself-button",
            }
        )


def setup(app):
    app.setup_extension("sdpa_notebooks")  # the notebooks it archives
    app.add_config_value("sdpa_dist_dir", "", "html", types=frozenset({str}))
    app.connect("html-page-context", link_run_page, priority=600)  # after the theme's menu
    app.connect("build-finished", write_downloads, priority=600)  # after sdpa_notebooks
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
