"""The executed notebook's code cells as a reader's run shows them, hidden cells marked.

In the execution cache every glue output is still in the cell that glued it. A value glued with
``display=False`` that has a rich form (a figure, a table) stays an output of its cell, which is
where ``sdpa_book.glue`` shows it outside the build; a plain value is dropped (the text states
it). A cell the site removes or folds keeps its code, starts with a comment saying how the site
shows it and what it does, and is folded in Jupyter.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass

RICH_MIME = ("image/", "text/html", "text/markdown", "text/latex")
IMAGE_SUFFIX = {
    "image/svg+xml": ".svg",
    "image/png": ".png",
    "image/jpeg": ".jpeg",
    "image/gif": ".gif",
}


def is_rich(bundle: dict) -> bool:
    return any(mime.startswith(RICH_MIME) for mime in bundle)


def image_name(mime: str, content: str) -> str:
    """The file name MyST-NB gives an image output: the hash of its bytes."""
    if mime == "image/svg+xml":
        data = os.linesep.join(content.splitlines()).encode("utf-8")
    else:
        data = base64.b64decode(content)
    return hashlib.sha256(data).hexdigest() + IMAGE_SUFFIX[mime]


@dataclass
class Cell:
    """A code cell of the executed notebook, with the outputs a reader's run shows."""

    cell: dict
    outputs: list
    glued: list[str]  # the names it glues


def split_glue(executed: dict, stored: dict) -> tuple[dict[int, Cell], dict[str, dict]]:
    """The code cells with the outputs a reader's run shows, and the glued values.

    ``executed`` is the executed notebook; from the execution cache it still holds the glue
    outputs, each in the cell that glued it. A value glued with ``display=False`` that has a rich
    form (figure, table) stays an output of its cell, as ``sdpa_book.glue`` shows it outside the
    build; a plain value is dropped (the text states it). ``stored`` is MyST-NB's glue data of
    the page, for values whose cell is unknown.

    Returns the cells by index, and the glued values by name: ``{"data": mime bundle, "cell":
    index or None}``.
    """
    glue: dict[str, dict] = {}
    cells: dict[int, Cell] = {}
    for index, cell in enumerate(executed["cells"]):
        if cell["cell_type"] != "code":
            continue
        outputs, glued = [], []
        for output in cell.get("outputs", []):
            scrapbook = output.get("metadata", {}).get("scrapbook")
            if not isinstance(scrapbook, dict):
                outputs.append(output)
                continue
            prefix = len(scrapbook.get("mime_prefix", ""))
            data = {mime[prefix:]: value for mime, value in output.get("data", {}).items()}
            glue[scrapbook["name"]] = {"data": data, "cell": index}
            glued.append(scrapbook["name"])
            if not prefix or is_rich(data):
                meta = {k: v for k, v in output.get("metadata", {}).items() if k != "scrapbook"}
                outputs.append({**output, "data": data, "metadata": meta})
        cells[index] = Cell(cell, outputs, glued)
    for name, output in stored.items():
        glue.setdefault(name, {"data": output.get("data", {}), "cell": None})
    return cells, glue


def _tags(cell: dict) -> set[str]:
    return {t.replace("_", "-") for t in cell.get("metadata", {}).get("tags", [])}


def describe(cell: Cell, glue: dict) -> str | None:
    """What a hidden cell does, in a few words, from its code, outputs and glue (None: unknown)."""
    source = cell.cell.get("source", "")
    images = tables = texts = widgets = 0
    for output in cell.outputs:
        data = output.get("data", {})
        if any(mime.startswith("image/") for mime in data):
            images += 1
        elif 'class="sdpa-widget' in str(data.get("text/html", "")):
            widgets += 1  # sdpa_book.widgets: an interactive figure, or its static picture
        elif str(data.get("text/markdown", "")).lstrip().startswith("|") or "<table" in str(
            data.get("text/html", "")
        ):
            tables += 1
        elif "text/markdown" in data or "text/html" in data:
            texts += 1
    values = sum(not is_rich(glue[name]["data"]) for name in cell.glued)
    parts = []
    if images:
        parts.append("draws the figure" if images == 1 else f"draws {images} figures")
    if tables:
        parts.append("writes the table" if tables == 1 else f"writes {tables} tables")
    if widgets:
        parts.append("shows the interactive figure (here, its first state)")
    if texts:
        parts.append("writes the text shown as its output")
    if values:
        parts.append(
            "passes a value to the text" if values == 1 else f"passes {values} values to the text"
        )
    if re.search(r"^\s*assert\b|np\.testing\.|\bassert_", source, re.M):
        parts.append("checks what the text claims")
    code = [ln for ln in source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if code and not parts and all(re.match(r"\s*(import|from)\s", ln) for ln in code):
        parts.append("imports what the page needs")
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def mark_hidden(cell: Cell, glue: dict) -> tuple[str, dict]:
    """The cell's source, with a first comment saying how the site shows it, and its metadata."""
    tags = _tags(cell.cell)
    source = cell.cell.get("source", "")
    meta = {k: v for k, v in cell.cell.get("metadata", {}).items() if k != "execution"}
    jupyter = dict(meta.get("jupyter", {}))
    what = describe(cell, glue)
    does = f": this cell {what}" if what else ""
    prompt = meta.get("mystnb", {}).get("code_prompt_show")
    behind = f' behind "{prompt.replace("{type}", "content")}"' if prompt else ""
    # A value glued here shows on the site where the text puts it: the reader sees it here.
    hide_outputs = not any(is_rich(glue[name]["data"]) for name in cell.glued)
    if "remove-cell" in tags or {"remove-input", "remove-output"} <= tags:
        note = f"Hidden on the website: this cell {what or 'sets up what later cells use'}."
        jupyter["source_hidden"] = True
    elif "remove-input" in tags:
        note = f"The website shows only this cell's output{does}."
        jupyter["source_hidden"] = True
    elif "hide-cell" in tags:
        note = f"Folded on the website{behind}{does}."
        jupyter["source_hidden"] = True
        jupyter["outputs_hidden"] = hide_outputs
    elif "hide-input" in tags:
        note = f"The website folds this cell's code{behind}{does}."
        jupyter["source_hidden"] = True
    elif "remove-output" in tags:
        note = f"The website shows this cell's code without its output{does}."
        jupyter["outputs_hidden"] = hide_outputs
    elif "hide-output" in tags:
        note = f"The website folds this cell's output{behind}{does}."
        jupyter["outputs_hidden"] = hide_outputs
    else:
        return source, meta
    meta["jupyter"] = jupyter
    if source.startswith("%%"):  # a cell magic must stay the first line
        first, _, rest = source.partition("\n")
        return f"{first}\n# {note}\n{rest}", meta
    return f"# {note}\n{source}", meta
