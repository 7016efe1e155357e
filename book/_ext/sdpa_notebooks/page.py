"""The reader's notebook of one executed page: the page's Markdown with its code cells in place.

The resolved doctree gives the Markdown (``markdown.MarkdownWriter``), the executed notebook the
code cells and their outputs (``cells``). Each code cell goes where the page shows it, or, for a
cell the page removes, before the first block that comes after it in the source. A figure that
the cell right above already shows (no prose between) keeps only its caption in the Markdown, so
running the notebook again gives the same notebook; any other image of the page is attached to
its Markdown cell. Cells get stable ids: an unchanged page gives the same notebook.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat
from docutils import nodes

from .cells import IMAGE_SUFFIX, Cell, image_name, mark_hidden, split_glue
from .markdown import MarkdownWriter, escape, none

SUFFIX_IMAGE = {".svg": "image/svg+xml", ".png": "image/png", ".jpg": "image/jpeg",
                ".jpeg": "image/jpeg", ".gif": "image/gif"}  # fmt: skip
# Written into each reader's notebook: one written by another version of this package is redone.
EXPORT = hashlib.sha256(
    b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
).hexdigest()[:12]


@dataclass
class Page:
    """What the reader's notebook of one page is made from."""

    docname: str
    doctree: nodes.document  # resolved
    executed: dict  # the executed notebook, from the execution cache if it is there
    glue: dict  # MyST-NB's glue data of the page (<page>.glue.json)
    header: str  # the first cell: what this notebook is
    link: Callable = none  # internal reference's refuri -> URL, or None for text only
    image_path: Callable = none  # image node -> the image's file
    number: Callable = none  # figure node -> "Fig. 2" when figures are numbered


def _line(node: nodes.Node) -> int | None:
    """The source line of a node, or of its first descendant that has one."""
    for n in node.findall(include_self=True):
        if isinstance(n, nodes.Element) and n.line:
            return n.line
    return None


class Layout:
    """The page in reading order, as ``items``: ``("md" | "heading", lines)`` or ``("code", i)``.

    ``attachments`` holds the images the Markdown refers to (file name -> mime bundle).
    """

    def __init__(self, page: Page, cells: dict[int, Cell], glue: dict):
        self.page, self.glue = page, glue
        self.images = {  # image file name -> the name it was glued under
            image_name(mime, content): name
            for name, value in glue.items()
            for mime, content in value["data"].items()
            if mime in IMAGE_SUFFIX
        }
        source_map = page.executed.get("metadata", {}).get("source_map") or []
        self.start = {i: source_map[i] if i < len(source_map) else 0 for i in cells}
        self.pending = sorted(cells)  # code cells not placed yet (the page may not show them)
        self.items: list[tuple[str, object]] = []
        self.attachments: dict[str, dict] = {}
        self.writer = MarkdownWriter(
            link=page.link, attach=self.attach, figure=self.figure, number=page.number
        )

    def attach(self, image: nodes.image) -> str:
        path = self.page.image_path(image)
        alt = escape(image.get("alt", ""))
        mime = SUFFIX_IMAGE.get(path.suffix.lower()) if path is not None else None
        if mime is None or not path.exists():
            return alt
        self.attachments[path.name] = {mime: base64.b64encode(path.read_bytes()).decode("ascii")}
        return f"![{alt}](attachment:{path.name})"

    def shown_since_prose(self, name: str) -> bool:
        """True when the glued value is an output of a cell placed since the last Markdown."""
        glued_in = self.glue.get(name, {}).get("cell")
        for kind, value in reversed(self.items):
            if kind != "code":
                return False
            if value == glued_in:
                return True
        return False

    def figure(self, node: nodes.figure) -> list[str] | None:
        """Only the caption of a figure that the code cell right above shows; else None."""
        image = node.next_node(nodes.image)
        name = self.images.get(Path(image["uri"]).name) if image is not None else None
        if name is not None and self.shown_since_prose(name):
            return self.writer.caption(node)
        return None

    def place_code(self, before_line: int | None = None, up_to: int | None = None) -> None:
        """Place the pending code cells that come before a line, or up to a cell index."""
        while self.pending and (
            (up_to is not None and self.pending[0] <= up_to)
            or (before_line is not None and self.start[self.pending[0]] < before_line)
        ):
            self.items.append(("code", self.pending.pop(0)))

    def walk(self, parent: nodes.Element, level: int) -> None:
        for child in parent.children:
            if isinstance(child, nodes.section):
                self.place_code(before_line=_line(child))
                title = next((c for c in child.children if isinstance(c, nodes.title)), None)
                if title is not None:
                    heading = "#" * min(level, 6) + " " + self.writer.text(title)
                    self.items.append(("heading", [heading]))
                self.walk(child, level + 1)
            elif isinstance(child, nodes.title):
                continue
            elif isinstance(child, nodes.Element) and child.get("nb_element") == "cell_code":
                self.place_code(up_to=child["cell_index"])
            else:
                self.place_code(before_line=_line(child))
                lines = self.writer.block(child)
                if lines:
                    self.items.append(("md", lines))


def _markdown_cell(source: str, attachments: dict[str, dict] | None = None):
    cell = nbformat.from_dict({"cell_type": "markdown", "source": source, "metadata": {}})
    names = sorted(set(re.findall(r"\(attachment:([^)\s]+)\)", source)))
    if names and attachments is not None:
        cell.attachments = {name: attachments[name] for name in names}
    return cell


def _notebook_cells(layout: Layout, cells: dict[int, Cell], glue: dict) -> list:
    """The items as notebook cells: a Markdown cell per section, code cells between."""
    out = []
    markdown: list[str] = []

    def flush() -> None:
        if markdown:
            out.append(_markdown_cell("\n".join(markdown), layout.attachments))
            markdown.clear()

    for kind, value in layout.items:
        if kind == "code":
            flush()
            cell = cells[value]
            source, meta = mark_hidden(cell, glue)
            out.append(nbformat.from_dict({
                "cell_type": "code", "source": source, "metadata": meta, "outputs": cell.outputs,
                "execution_count": cell.cell.get("execution_count"),
            }))  # fmt: skip
        else:
            if kind == "heading":
                flush()  # a cell per section
            markdown += [""] * bool(markdown) + value
    flush()
    return out


def reader_notebook(page: Page) -> nbformat.NotebookNode:
    """The reader's notebook of one executed page."""
    cells, glue = split_glue(page.executed, page.glue)
    layout = Layout(page, cells, glue)
    layout.walk(page.doctree, 1)
    layout.place_code(up_to=max(cells, default=-1))

    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {
        k: v
        for k, v in page.executed.get("metadata", {}).items()
        if k in ("kernelspec", "language_info")
    }
    notebook.metadata["sdpa_book"] = {"page": page.docname, "export": EXPORT}
    out = [_markdown_cell(page.header), *_notebook_cells(layout, cells, glue)]
    if layout.writer.citations:
        works = [f"- {escape(work)}" for work in layout.writer.citations.values()]
        out.append(_markdown_cell("\n".join(["## References", "", *works])))
    for n, cell in enumerate(out):  # stable ids: an unchanged page gives the same notebook
        cell["id"] = hashlib.sha1(f"{page.docname}\0{n}".encode()).hexdigest()[:12]
    notebook.cells = out
    nbformat.validate(notebook)
    return notebook
