"""The package's structure: imports run one way, and nothing outside it uses its internals.

The layers are those of the API page's table (book/appendix/api.md): a module imports only
modules of its own layer or of the layers before it. Outside the package (tests, benchmarks,
the book's pages) no underscored name of ``sdpa`` is imported or used; the book and the
benchmarks import only names that a module lists in its ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "sdpa"

# In import order; a module may import from its own layer and from earlier layers only.
LAYERS = [
    {"_checks", "softmax", "masks", "examples", "plotting"},
    {"problem"},
    {"threads", "tiled", "cost_model", "blocked", "iomodel"},
    {"attention"},
    {"backward", "softmax_grad", "gradcheck"},
    {"rope", "alibi", "kvcache", "linear"},
    {"multihead", "positional"},
    {"nn"},  # a subpackage: the small language model, built on the public API
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}
UNLAYERED = {"__init__", "__main__"}


def package_modules() -> list[str]:
    """The modules of ``sdpa`` and its subpackages (each subpackage counts as one module)."""
    modules = [p.stem for p in PACKAGE.glob("*.py")]
    modules += [p.parent.name for p in PACKAGE.glob("*/__init__.py")]
    return sorted(modules)


def source_files(module: str) -> list[Path]:
    single = PACKAGE / f"{module}.py"
    return [single] if single.exists() else sorted((PACKAGE / module).rglob("*.py"))


def imported_modules(module: str) -> set[str]:
    """The modules of ``sdpa`` that ``module`` imports (``from .x import ...``, ``from . import
    x``; inside a subpackage ``from ..x import ...``; ``from .. import name`` is the package's
    public API, whose layer is the last)."""
    found = set()
    for path in source_files(module):
        depth = len(path.relative_to(PACKAGE).parts)  # 1 in sdpa/, 2 in a subpackage
        # Top-level statements only: test_no_import_inside_a_function keeps imports there.
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom) or node.level != depth:
                continue
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names if alias.name in LAYER_OF)
    return found


def test_every_module_has_a_layer():
    layered = set(LAYER_OF) | UNLAYERED
    missing = [m for m in package_modules() if m not in layered]
    assert not missing, f"add {missing} to a layer of LAYERS (and to the API page's table)"


@pytest.mark.parametrize("module", sorted(set(LAYER_OF) & set(package_modules())))
def test_imports_run_one_way(module):
    later = {
        name: LAYER_OF[name]
        for name in imported_modules(module)
        if name in LAYER_OF and LAYER_OF[name] > LAYER_OF[module]
    }
    assert not later, f"sdpa.{module} (layer {LAYER_OF[module]}) imports later layers: {later}"


def test_the_core_imports_no_implementation():
    # The problem is the start of every path; the tiled path does not know the reference path.
    assert not {"attention", "tiled", "backward", "cost_model"} & imported_modules("problem")
    assert not {"attention", "backward", "cost_model"} & imported_modules("tiled")


def test_no_import_inside_a_function():
    # Imports at the top show a module's dependencies (the optional plotting backend aside).
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and node.level >= 1:
                    raise AssertionError(
                        f"{path.name}:{node.lineno}: import sdpa modules at the top of the module"
                    )


# -- outside the package ------------------------------------------------------------------


def code_of(path: Path) -> str:
    """The Python of a test, a benchmark, or a book page's code cells."""
    text = path.read_text()
    if path.suffix == ".md":
        cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
        # Each cell may open with options: ":key: value" lines or a "---" YAML block.
        cells = [
            re.sub(r"\A(---\n.*?\n---\n|(:[^\n]*\n)+)", "", cell, flags=re.DOTALL) for cell in cells
        ]
        return "\n".join(cells)
    return text


def outside_files(*where: str) -> list[Path]:
    files = []
    for folder in where:
        base = ROOT / folder
        files += sorted(base.rglob("*.py")) + sorted(base.rglob("*.md"))
    return [f for f in files if "_build" not in f.parts and f.name != Path(__file__).name]


def parse(path: Path) -> ast.Module:
    code = code_of(path)
    # A book cell may hold IPython syntax (%magic, !command): blank those lines out.
    code = re.sub(r"^\s*[%!].*$", "", code, flags=re.MULTILINE)
    return ast.parse(code)


def sdpa_imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from sdpa... import name`` and ``import sdpa...``."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "sdpa" or node.module.startswith("sdpa."):
                found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sdpa."):
                    module, _, name = alias.name.rpartition(".")
                    found.append((module, name))
    return found


def sdpa_attributes(path: Path) -> list[str]:
    """Dotted names ``sdpa.x.y`` used in the code (attribute chains starting at ``sdpa``)."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Attribute):
            parts = []
            inner = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "sdpa":
                found.append(".".join(["sdpa", *reversed(parts)]))
    return found


def is_internal(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


@pytest.mark.parametrize(
    "path",
    outside_files("tests", "benchmarks", "book", "src/sdpa_book"),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_underscored_name_of_sdpa_is_used_outside_it(path):
    underscored = [f"from {m} import {n}" for m, n in sdpa_imports(path) if is_internal(f"{m}.{n}")]
    underscored += [name for name in sdpa_attributes(path) if is_internal(name)]
    assert not underscored, f"{path.name} uses internals of sdpa: {underscored}"


@pytest.mark.parametrize(
    "path", outside_files("benchmarks", "book"), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_book_and_the_benchmarks_import_only_public_names(path):
    private = []
    for module, name in sdpa_imports(path):
        exported = getattr(importlib.import_module(module), "__all__", None)
        is_module = (PACKAGE / f"{name}.py").exists() if module == "sdpa" else False
        if exported is not None and name not in exported and not is_module:
            private.append(f"from {module} import {name}")
    assert not private, f"{path.name} imports names outside __all__: {private}"


def test_every_public_module_is_on_the_api_page():
    page = (ROOT / "book" / "appendix" / "api.md").read_text()
    for module in package_modules():
        if module.startswith("_"):
            continue
        exported = getattr(importlib.import_module(f"sdpa.{module}"), "__all__", [])
        if not exported:
            continue
        documented = f"automodule:: sdpa.{module}" in page
        in_sdpa = all(name in importlib.import_module("sdpa").__all__ for name in exported)
        assert documented or in_sdpa, (
            f"sdpa.{module} exports {exported}: document it on the API page"
        )
