"""numpydoc's docstring validation of the public API (``make lint`` runs this file too).

Every function and class that a module of ``sdpa`` lists in ``__all__`` is validated with the
checks of ``[tool.numpydoc_validation]`` in pyproject.toml: every parameter documented with a
description, a Returns section that describes what comes back, an Examples section, and so on.
The checks left out there are those the house style does not ask for (a See Also section, an
extended summary, a type for each name of a group of parameters described together).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import tomllib
from pathlib import Path

import pytest
from numpydoc.validate import validate

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["numpydoc_validation"]
IGNORED = {code for code in CONFIG["checks"] if code != "all"}


def public_objects() -> list[str]:
    names = []
    package = ROOT / "src" / "sdpa"
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if any(part.startswith("_") for part in parts):
            continue  # private modules, and the __init__ of a subpackage (its names live below)
        module = importlib.import_module(".".join(["sdpa", *parts]))
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if (
                inspect.isfunction(obj) or inspect.isclass(obj)
            ) and obj.__module__ == module.__name__:
                names.append(f"{module.__name__}.{name}")
    return names


@pytest.mark.parametrize("name", public_objects())
def test_public_docstring_is_valid(name):
    errors = [(code, message) for code, message in validate(name)["errors"] if code not in IGNORED]
    module, _, attr = name.rpartition(".")
    obj = getattr(importlib.import_module(module), attr)
    if dataclasses.is_dataclass(obj):  # fields are documented as Attributes, not Parameters
        errors = [(code, message) for code, message in errors if code != "PR01"]
    assert not errors, "\n".join(f"{name}: {code} {message}" for code, message in errors)
