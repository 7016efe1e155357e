"""The execution cache follows the package: a change to ``src/sdpa`` re-executes the book.

jupyter-cache keys a page on its own code cells only, so a page whose code did not change would
keep the outputs of an older package. This extension keys the cache folder, and a configuration
value, on a fingerprint of the packages the pages import (``sdpa_cache_packages``) and of the
Python and library versions (``sdpa_cache_distributions``):

* the cache lives in ``<doctrees>/jupyter-cache/sdpa-<fingerprint>``, so a changed package finds
  an empty cache and every page executes against the new code; reverting the package finds the
  older cache again (the last ``KEEP_OLD_CACHES`` are kept);
* ``sdpa_package_fingerprint`` is a configuration value that changes with it, so Sphinx sees a
  changed configuration and re-reads every page (without which myst-nb would not look at the
  cache at all).

A cache path set explicitly (``-D nb_execution_cache_path=...``) is left alone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

from jupyter_cache import get_cache

KEEP_OLD_CACHES = 2  # besides the current one, so that switching back and forth stays cheap


def package_fingerprint(package_dirs: list[Path], distributions: list[str]) -> str:
    """Hash of everything the executed pages depend on besides their own code."""
    digest = hashlib.sha256()
    for package_dir in package_dirs:
        # A folder counts by its Python files; a single file (a committed result) by itself.
        paths = [package_dir] if package_dir.is_file() else sorted(package_dir.rglob("*.py"))
        for path in paths:
            digest.update(path.relative_to(package_dir.parent).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    versions = [f"python {sys.version_info[0]}.{sys.version_info[1]}"]
    for dist in distributions:
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} missing")
    digest.update("\n".join(versions).encode())
    return digest.hexdigest()[:16]


def key_execution_cache(app, config) -> None:
    """Set the fingerprint; put the cache in <doctrees>/jupyter-cache/<fingerprint>, prune old ones.

    Runs at ``config-inited``: before Sphinx compares the configuration with the saved
    environment's, and before myst-nb reads ``nb_execution_cache_path`` (``builder-inited``).
    """
    packages = [Path(app.confdir) / folder for folder in config.sdpa_cache_packages]
    config.sdpa_package_fingerprint = package_fingerprint(
        packages, list(config.sdpa_cache_distributions)
    )
    # Models the pages train once per build and share (sdpa_book.pages.lm.trained_lm) live beside
    # the execution cache; the kernels the pages run in inherit this environment.
    os.environ.setdefault("SDPA_MODEL_CACHE", str(Path(app.doctreedir) / "models"))
    if config.nb_execution_cache_path:  # set explicitly (-D or conf): leave it alone
        return
    root = Path(app.doctreedir) / "jupyter-cache"
    current = root / f"sdpa-{config.sdpa_package_fingerprint}"
    config.nb_execution_cache_path = str(current)
    if root.is_dir():
        old = sorted(
            (p for p in root.iterdir() if p.is_dir() and p != current),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for stale in old[KEEP_OLD_CACHES:]:
            shutil.rmtree(stale, ignore_errors=True)
    current.mkdir(parents=True, exist_ok=True)
    os.utime(current)
    # The cache's database is created here, once: the processes of a parallel build that
    # execute their first pages at the same moment would otherwise race to create its tables.
    get_cache(current).list_cache_records()


def setup(app):
    app.setup_extension("myst_nb")  # nb_execution_cache_path is myst-nb's
    # Folders (their .py files) or single files relative to the configuration directory, and
    # distributions whose versions count.
    app.add_config_value("sdpa_cache_packages", ["src/sdpa"], "env", types=frozenset({list}))
    app.add_config_value("sdpa_cache_distributions", [], "env", types=frozenset({list}))
    # A changed value marks the configuration as changed, so Sphinx re-reads every page.
    app.add_config_value("sdpa_package_fingerprint", "", "env", types=frozenset({str}))
    app.connect("config-inited", key_execution_cache)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
