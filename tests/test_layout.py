"""The package's structure: imports run one way, and nothing outside it uses its internals.

The layers are those of the API page's table (book/appendix/api.md): a module imports only
modules of its own layer or of the layers before it. Outside the package (tests, benchmarks,
the book's pages) no underscored name of ``sdpa`` is imported or used; the book and the
benchmarks import only names that a module lists in its ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "sdpa"

# In import order; a module may import from its own layer and from earlier layers only.
LAYERS = [
    {"_checks", "softmax_stable", "masks", "block_mask", "examples", "plotting"},
    {"problem"},
    {"threads", "tuning", "tiles", "tiled", "cost_model", "blocked", "iomodel"},
    {"attention", "flex_call", "flex"},
    {"backward", "softmax_grad", "finite_diff"},
    {"rope", "alibi", "kvcache", "paged_kvcache", "linear", "merge", "flex_mods"},
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
    code = re.sub(
        r"^\s*(%|!(?!=)).*$", "", code, flags=re.MULTILINE
    )  # not a line that opens with !=
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
    "path",
    outside_files("benchmarks", "book", "src/sdpa_book"),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_book_and_the_benchmarks_import_only_public_names(path):
    private = []
    for module, name in sdpa_imports(path):
        exported = getattr(importlib.import_module(module), "__all__", None)
        is_module = module == "sdpa" and (
            (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()
        )  # a module or a subpackage (sdpa.nn, sdpa.iomodel)
        if exported is not None and name not in exported and not is_module:
            private.append(f"from {module} import {name}")
    assert not private, f"{path.name} imports names outside __all__: {private}"


def test_every_public_module_is_on_the_api_page():
    api = ROOT / "book" / "appendix"
    page = "\n".join(p.read_text() for p in [api / "api.md", *sorted((api / "api").glob("*.md"))])
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


# -- the package face ------------------------------------------------------------------------


def test_no_module_imports_the_package_face():
    # `from .. import name` in sdpa.nn, or `from sdpa import name` anywhere in the package, runs
    # sdpa/__init__.py while it is still importing: statement order alone would keep that loop
    # from failing. Import from the module that defines the name.
    face = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py":
            continue
        depth = len(path.relative_to(PACKAGE).parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            names = [alias.name for alias in node.names]
            if node.level == 0 and node.module == "sdpa":
                face.append(f"{path.relative_to(PACKAGE)}:{node.lineno} from sdpa import {names}")
            elif node.level == depth and node.module is None:
                not_modules = [n for n in names if n not in package_modules()]
                if not_modules:
                    face.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {not_modules}")
    assert not face, f"imports through the package face: {face}"


def test_no_public_module_is_shadowed_by_a_function():
    # `sdpa.softmax` was both a module and the function the package exports under that name.
    import sdpa

    for module in package_modules():
        if hasattr(sdpa, module):
            importlib.import_module(f"sdpa.{module}")
            assert inspect.ismodule(getattr(sdpa, module)), (
                f"sdpa.{module} is a module and a {type(getattr(sdpa, module)).__name__} of the "
                "package face: rename one"
            )


# -- sizes -----------------------------------------------------------------------------------

CODE_FILES = sorted(
    [*(ROOT / "src").rglob("*.py"), *(ROOT / "book" / "_ext").rglob("*.py"), ROOT / "conf.py"]
)
MAX_FILE_LINES = 1200
MAX_FUNCTION_LINES = 150  # of code: a docstring does not count
MAX_COMPLEXITY = 15  # McCabe's, as ruff's C901 counts it


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of code of every function (nested ones too), its docstring left out."""
    lengths = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant):
                if isinstance(doc.value.value, str):
                    lines -= doc.end_lineno - doc.lineno + 1
            lengths[f"{node.name} (line {node.lineno})"] = lines
    return lengths


@pytest.mark.parametrize("path", CODE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_functions_fit_their_rooms(path):
    n_lines = len(path.read_text().splitlines())
    assert n_lines <= MAX_FILE_LINES, f"{n_lines} lines: split the file by job"
    long = {f: n for f, n in function_lengths(path).items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions above {MAX_FUNCTION_LINES} lines of code: {long}"


def test_function_lengths_count_code_not_docstrings(tmp_path):
    source = tmp_path / "f.py"
    source.write_text('def f():\n    """One\n\n    two.\n    """\n    x = 1\n    return x\n')
    assert function_lengths(source) == {"f (line 1)": 3}


def test_no_function_is_too_complex():
    ruff = [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "C901"]
    ruff += ["--config", f"lint.mccabe.max-complexity={MAX_COMPLEXITY}", "--output-format=concise"]
    result = subprocess.run(
        [*ruff, *(str(p) for p in CODE_FILES)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- rooms that fit ----------------------------------------------------------------------------

#: The most lines a module of the package may hold: one job per module, read in one sitting.
MODULE_LINES = 800


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_every_module_fits_its_room(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by job"
