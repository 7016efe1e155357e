"""Each executed page offered as a notebook a reader can run, and the package shipped with the site.

MyST-NB writes each executed page as a notebook (``<builddir>/jupyter_execute/<page>.ipynb``),
but that one is the build's: its Markdown is MyST (``{glue:text}``, ``{ref}``, ``{cite:p}``,
directives), the values glued with ``display=False`` are not in it, and when the page came from
the execution cache it has no outputs at all. Once the site is built, this extension writes the
reader's notebook of every executed page instead:

* **Markdown from the resolved page.** Each Markdown cell is written from the page's resolved
  doctree, the one the HTML is written from, so every role and directive reads as on the site:
  glued numbers in place, cross-references as the title they point to (links to the site when
  ``sdpa_notebooks_baseurl`` or ``html_baseurl`` is set), citations as on the page with the
  cited works listed at the end, maths as ``$...$``, admonitions as quotes, dropdowns as
  ``<details>``, tables as pipe tables. Nothing here knows the pages: it converts nodes.
* **Code cells as a reader's run shows them.** Code and outputs come from the executed notebook
  in the execution cache, where every glue output is still in the cell that glued it. A value
  glued with ``display=False`` that has a rich form (a figure, a table) stays an output of its
  cell, which is where ``sdpa_book.glue`` shows it outside the build; where the page shows it
  right after (no prose between), the Markdown keeps only its caption, so running the notebook
  again gives the same notebook. Plain glued values are only in the text.
* **Hidden cells stay.** A cell the site removes or folds keeps its code, starts with a comment
  saying how the site shows it and what it does, and is folded in Jupyter.

The notebooks replace MyST-NB's in ``_sources/`` (the theme's download menu links them). The
menu of every page also links the page "Run it yourself" and one archive with every notebook,
the ``sdpa`` wheel and a pinned ``requirements.txt``, all in the site's ``downloads/``. The wheel
and source archive are built by ``make html`` into ``<builddir>/dist`` (``sdpa_dist_dir``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from urllib.parse import urljoin

import nbformat
from docutils import nodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

DOWNLOADS = "downloads"  # the site's folder for the wheel, sdist, requirements and archive
RUN_PAGE = "run-it-yourself"  # the page that says how to run the notebooks
# What a reader's environment needs besides the wheel's own dependencies.
READER_PACKAGES = ["numpy", "matplotlib", "ipykernel", "nbclient"]
RICH_MIME = ("image/", "text/html", "text/markdown", "text/latex")
IMAGE_SUFFIX = {
    "image/svg+xml": ".svg",
    "image/png": ".png",
    "image/jpeg": ".jpeg",
    "image/gif": ".gif",
}
SUFFIX_IMAGE = {".svg": "image/svg+xml", ".png": "image/png", ".jpg": "image/jpeg",
                ".jpeg": "image/jpeg", ".gif": "image/gif"}  # fmt: skip
ZIP_DATE = (2026, 1, 1, 0, 0, 0)  # fixed, so that an unchanged book gives the same archive
# Written into each reader's notebook: one written by another version of this file is redone.
EXPORT = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


# --------------------------------------------------------------------------------------------
# Markdown from a resolved doctree.

_ESCAPE = re.compile(r"([\\`*_\[\]<>$|~])")
_LINE_START = re.compile(r"^(\s*)([#>+=-]|\d+[.)])")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_SKIP = (nodes.target, nodes.comment, nodes.substitution_definition, nodes.system_message,
         nodes.pending)  # fmt: skip
_SKIP_TAGS = {"toctree", "index", "only", "meta", "tabular_col_spec"}


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text)


def escape(text: str) -> str:
    """Text that Jupyter's Markdown shows as itself (no emphasis, maths, HTML or table cells)."""
    return _ESCAPE.sub(r"\\\1", _one_line(text))


def code_span(text: str) -> str:
    text = _one_line(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def fenced(text: str, language: str = "") -> list[str]:
    fence = "`" * (max((len(run) for run in re.findall(r"`{3,}", text)), default=2) + 1)
    return [f"{fence}{language}", *text.rstrip("\n").split("\n"), fence]


def _prefix(lines: list[str], first: str, rest: str) -> list[str]:
    """Lines prefixed (a list marker, a quote); blank lines get the prefix without its spaces."""
    out = []
    for i, line in enumerate(lines):
        mark = first if i == 0 else rest
        out.append(mark + line if line else mark.rstrip())
    return out


def _wrap(inner: str, mark: str) -> str:
    """``inner`` between ``mark``s, with its outer spaces outside them (Markdown needs that)."""
    stripped = inner.strip()
    if not stripped:
        return inner
    lead = inner[: len(inner) - len(inner.lstrip())]
    tail = inner[len(inner.rstrip()) :]
    return f"{lead}{mark}{stripped}{mark}{tail}"


def _none(node):
    return None


@dataclass
class MarkdownWriter:
    """Writes resolved docutils nodes as Jupyter Markdown.

    ``link(refuri)`` gives the URL of an internal reference, or ``None`` to write its text only;
    ``attach(image)`` the Markdown of an image; ``figure(node)`` the lines that replace a figure,
    or ``None`` to write it whole; ``number(figure)`` its number ("Fig. 2") or ``None``. The works
    cited are collected in ``citations`` (URL -> full reference).
    """

    link: Callable = _none
    attach: Callable = lambda image: escape(image.get("alt", ""))  # noqa: E731
    figure: Callable = _none
    number: Callable = _none
    citations: dict[str, str] = field(default_factory=dict)

    # -- inline ---------------------------------------------------------------------------

    def text(self, node: nodes.Node) -> str:
        """The inline Markdown of a paragraph-like node, on one line."""
        return "".join(self.inline(child) for child in node.children).strip()

    def inline(self, node: nodes.Node) -> str:  # noqa: C901 - one branch per node type
        if isinstance(node, nodes.Text):
            return escape(node.astext())
        if isinstance(node, _SKIP):
            return ""
        if isinstance(node, nodes.raw):
            return _one_line(node.astext()) if node.get("format") == "html" else ""
        if isinstance(node, nodes.literal):
            return code_span(node.astext())
        if isinstance(node, nodes.math):
            return f"${_one_line(node.astext().strip())}$"
        if isinstance(node, nodes.image):
            return self.attach(node)
        if isinstance(node, nodes.footnote_reference):
            return f"<sup>{escape(node.astext())}</sup>"
        inner = "".join(self.inline(child) for child in node.children)
        if isinstance(node, nodes.emphasis):
            return _wrap(inner, "*")
        if isinstance(node, nodes.strong):
            return _wrap(inner, "**")
        if isinstance(node, (nodes.subscript, nodes.superscript)):
            tag = "sub" if isinstance(node, nodes.subscript) else "sup"
            return f"<{tag}>{inner}</{tag}>"
        if isinstance(node, nodes.reference):
            return self._reference(node, inner)
        return inner

    def _reference(self, node: nodes.reference, inner: str) -> str:
        refuri = node.get("refuri", "")
        citation = node.parent is not None and "bibtex-citation" in node.parent.get("classes", [])
        if citation and node.get("reftitle"):
            self.citations.setdefault(refuri, node["reftitle"])
        if _SCHEME.match(refuri) and not node.get("internal"):
            return f"[{inner}]({refuri})" if inner.strip() else f"<{refuri}>"
        url = self.link(refuri) if refuri else None
        if url and inner.strip():
            return f"[{inner}]({url})"
        if (
            citation
            or not re.search(r"[^\W\d_]", inner)
            or inner.lstrip().startswith(("`", "*", "$"))
        ):
            return inner
        return _wrap(inner, "*")  # a cross-reference: the title of what it points to

    # -- blocks ---------------------------------------------------------------------------

    def blocks(self, children) -> list[str]:
        """Block nodes as lines, a blank line between blocks."""
        out: list[str] = []
        for child in children:
            lines = self.block(child)
            if lines:
                out += [""] * bool(out) + lines
        return out

    def block(self, node: nodes.Node) -> list[str]:  # noqa: C901 - one branch per node type
        if isinstance(node, _SKIP) or node.tagname in _SKIP_TAGS:
            return []
        if isinstance(node, nodes.Text):
            text = escape(node.astext()).strip()
            return [text] if text else []
        if isinstance(node, nodes.paragraph):
            text = self.text(node)
            return [_LINE_START.sub(r"\1\\\2", text)] if text else []
        if isinstance(node, (nodes.title, nodes.rubric)):
            return [f"**{self.text(node)}**"]
        if isinstance(node, nodes.math_block):
            return self._math_block(node)
        if isinstance(node, nodes.literal_block):
            language = node.get("language", "")
            language = {"ipython3": "python", "ipython": "python", "default": "", "none": "",
                        "myst-ansi": "", "text": ""}.get(language, language)  # fmt: skip
            return fenced(node.astext(), language)
        if isinstance(node, nodes.doctest_block):
            return fenced(node.astext(), "python")
        if isinstance(node, nodes.bullet_list):
            return self._list(node, lambda i: "- ")
        if isinstance(node, nodes.enumerated_list):
            start = node.get("start", 1)
            return self._list(node, lambda i: f"{start + i}. ")
        if isinstance(node, (nodes.definition_list, nodes.field_list)):
            return self._definitions(node)
        if isinstance(node, nodes.block_quote):
            return _prefix(self.blocks(node.children), "> ", "> ")
        if isinstance(node, nodes.line_block):
            lines = [self.text(line) for line in node.children if isinstance(line, nodes.line)]
            return ["<br>".join(lines)]
        if isinstance(node, nodes.transition):
            return ["---"]
        if isinstance(node, nodes.figure):
            replaced = self.figure(node)
            return replaced if replaced is not None else self._figure(node)
        if isinstance(node, nodes.image):
            return [self.attach(node)]
        if isinstance(node, nodes.table):
            return self._table(node)
        if isinstance(node, (nodes.footnote, nodes.citation)):
            label = node.next_node(nodes.label)
            body = [c for c in node.children if not isinstance(c, nodes.label)]
            return _prefix(self.blocks(body), f"[{label.astext() if label else ''}] ", "    ")
        if isinstance(node, nodes.raw):
            return node.astext().split("\n") if node.get("format") == "html" else []
        if node.tagname == "desc":
            return self._desc(node)
        if self._is_dropdown(node):
            return self._dropdown(node)
        if isinstance(node, (nodes.Admonition, nodes.topic, nodes.sidebar)):
            return self._admonition(node)
        if isinstance(node, nodes.TextElement):
            text = self.text(node)
            return [text] if text else []
        return self.blocks(node.children)

    def _math_block(self, node: nodes.math_block) -> list[str]:
        tex = node.astext().strip("\n").split("\n")
        if node.get("nowrap"):  # an environment of its own (amsmath): Jupyter typesets it as is
            return tex
        number = node.get("number")
        tag = [f"\\tag{{{number}}}"] if type(number) is int else []
        return ["$$", *tex, *tag, "$$"]

    def _list(self, node, marker) -> list[str]:
        items = [self.blocks(item.children) for item in node.children]
        loose = any("" in lines for lines in items)
        out: list[str] = []
        for i, lines in enumerate(items):
            mark = marker(i)
            out += [""] * (loose and bool(out)) + _prefix(lines or [""], mark, " " * len(mark))
        return out

    def _definitions(self, node) -> list[str]:
        out: list[str] = []
        for item in node.children:
            terms = [c for c in item.children if isinstance(c, (nodes.term, nodes.field_name))]
            body = [c for c in item.children if isinstance(c, (nodes.definition, nodes.field_body))]
            head = " ".join(f"**{self.text(t)}**" for t in terms)
            lines = self.blocks(body[0].children) if body else []
            if lines and lines[0] and not lines[0].startswith(("- ", "> ", "```", "$$", "<")):
                lines[0] = f"{head}: {lines[0]}"
            else:
                lines = [head, *lines]
            out += _prefix(lines, "- ", "  ")
        return out

    def _label(self, figure: nodes.figure) -> str:
        return f"**{self.number(figure) or 'Figure'}.**"

    def caption(self, figure: nodes.figure) -> list[str]:
        """A figure's caption and legend, without its image."""
        caption = figure.next_node(nodes.caption)
        legend = figure.next_node(nodes.legend)
        out = [f"{self._label(figure)} {self.text(caption)}"] if caption is not None else []
        if legend is not None:
            out += [""] * bool(out) + self.blocks(legend.children)
        return out

    def _figure(self, figure: nodes.figure) -> list[str]:
        images = [self.attach(image) for image in figure.findall(nodes.image)]
        caption = self.caption(figure)
        return images + [""] * bool(images and caption) + caption

    def _table(self, table: nodes.table) -> list[str]:
        group = table.next_node(nodes.tgroup)
        if group is None:
            return self.blocks(table.children)
        rows, aligns, head = [], [], None
        for part in group.children:
            if not isinstance(part, (nodes.thead, nodes.tbody)):
                continue
            for row in part.children:
                cells = []
                for entry in row.children:
                    text = "<br>".join(" ".join(self.block(c)) for c in entry.children)
                    cells.append(re.sub(r"(?<!\\)\|", r"\\|", text))
                    if isinstance(part, nodes.tbody) and len(aligns) < len(row.children):
                        classes = entry.get("classes", [])
                        aligns.append(
                            "--:" if "text-right" in classes
                            else ":-:" if "text-center" in classes
                            else ":--" if "text-left" in classes
                            else "---"
                        )  # fmt: skip
                if isinstance(part, nodes.thead) and head is None:
                    head = cells
                else:
                    rows.append(cells)
        width = max(len(r) for r in [head or [], *rows]) if head or rows else 0
        if not width:
            return []
        head = (head or [""] * width) + [""] * (width - len(head or [""] * width))
        aligns += ["---"] * (width - len(aligns))
        out = []
        title = next((c for c in table.children if isinstance(c, nodes.title)), None)
        if title is not None:
            out += [f"**{self.text(title)}**", ""]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(aligns) + "|")
        out += ["| " + " | ".join(r + [""] * (width - len(r))) + " |" for r in rows]
        return out

    def _desc(self, node) -> list[str]:
        """An API entry (autodoc, ``py:function``): its signatures as code, then its text."""
        out: list[str] = []
        for child in node.children:
            if child.tagname == "desc_signature":
                parts = []
                for part in child.children:
                    if part.tagname == "desc_parameterlist":
                        parts.append("(" + ", ".join(p.astext() for p in part.children) + ")")
                    elif part.tagname == "desc_returns":
                        parts.append(" -> " + part.astext())
                    else:
                        parts.append(part.astext())
                out += [""] * bool(out) + [code_span("".join(parts).strip())]
            else:
                lines = self.blocks(child.children)
                out += [""] * bool(out and lines) + _prefix(lines, "> ", "> ")
        return out

    @staticmethod
    def _is_dropdown(node) -> bool:
        classes = node.get("classes", []) if isinstance(node, nodes.Element) else []
        return (
            node.tagname == "dropdown_main"
            or "toggle" in classes
            or (isinstance(node, nodes.Admonition) and "dropdown" in classes)
        )

    def _dropdown(self, node) -> list[str]:
        """A dropdown (sphinx-design, togglebutton) as ``<details>``: folded, as on the site."""
        title = next((c for c in node.children if c.tagname in ("dropdown_title", "title")), None)
        summary = ""
        if title is not None:
            texts = [n for n in title.findall(nodes.inline) if "sd-summary-text" in n["classes"]]
            summary = self.text(texts[0] if texts else title)
        body = [c for c in node.children if c is not title]
        return ["<details>", f"<summary>{summary or 'Details'}</summary>", "",
                *self.blocks(body), "", "</details>"]  # fmt: skip

    def _admonition(self, node) -> list[str]:
        title = next((c for c in node.children if isinstance(c, nodes.title)), None)
        heading = (
            self.text(title) if title is not None else node.tagname.replace("_", " ").capitalize()
        )
        body = [c for c in node.children if c is not title]
        return _prefix([f"**{heading}**", "", *self.blocks(body)], "> ", "> ")


# --------------------------------------------------------------------------------------------
# The reader's notebook of one page.


def _is_rich(bundle: dict) -> bool:
    return any(mime.startswith(RICH_MIME) for mime in bundle)


def _image_name(mime: str, content: str) -> str:
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
            if not prefix or _is_rich(data):
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
    images = tables = texts = 0
    for output in cell.outputs:
        data = output.get("data", {})
        if any(mime.startswith("image/") for mime in data):
            images += 1
        elif str(data.get("text/markdown", "")).lstrip().startswith("|") or "<table" in str(
            data.get("text/html", "")
        ):
            tables += 1
        elif "text/markdown" in data or "text/html" in data:
            texts += 1
    values = sum(not _is_rich(glue[name]["data"]) for name in cell.glued)
    parts = []
    if images:
        parts.append("draws the figure" if images == 1 else f"draws {images} figures")
    if tables:
        parts.append("writes the table" if tables == 1 else f"writes {tables} tables")
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
    hide_outputs = not any(_is_rich(glue[name]["data"]) for name in cell.glued)
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


def _line(node: nodes.Node) -> int | None:
    """The source line of a node, or of its first descendant that has one."""
    for n in node.findall(include_self=True):
        if isinstance(n, nodes.Element) and n.line:
            return n.line
    return None


@dataclass
class Page:
    """What the reader's notebook of one page is made from."""

    docname: str
    doctree: nodes.document  # resolved
    executed: dict  # the executed notebook, from the execution cache if it is there
    glue: dict  # MyST-NB's glue data of the page (<page>.glue.json)
    header: str  # the first cell: what this notebook is
    link: Callable = _none  # internal reference's refuri -> URL, or None for text only
    image_path: Callable = _none  # image node -> the image's file
    number: Callable = _none  # figure node -> "Fig. 2" when figures are numbered


def reader_notebook(page: Page) -> nbformat.NotebookNode:  # noqa: C901
    """The reader's notebook of one executed page."""
    cells, glue = split_glue(page.executed, page.glue)
    images = {  # image file name -> the name it was glued under
        _image_name(mime, content): name
        for name, value in glue.items()
        for mime, content in value["data"].items()
        if mime in IMAGE_SUFFIX
    }
    source_map = page.executed.get("metadata", {}).get("source_map") or []
    start = {i: source_map[i] if i < len(source_map) else 0 for i in cells}
    pending = sorted(cells)  # code cells not placed yet (the page may not show them)
    items: list[tuple[str, object]] = []  # ("md" | "heading", lines) or ("code", index)
    attachments: dict[str, dict] = {}

    def attach(image: nodes.image) -> str:
        path = page.image_path(image)
        alt = escape(image.get("alt", ""))
        mime = SUFFIX_IMAGE.get(path.suffix.lower()) if path is not None else None
        if mime is None or not path.exists():
            return alt
        attachments[path.name] = {mime: base64.b64encode(path.read_bytes()).decode("ascii")}
        return f"![{alt}](attachment:{path.name})"

    def shown_since_prose(name: str) -> bool:
        """True when the glued value is an output of a cell placed since the last Markdown."""
        glued_in = glue.get(name, {}).get("cell")
        for kind, value in reversed(items):
            if kind != "code":
                return False
            if value == glued_in:
                return True
        return False

    def figure(node: nodes.figure) -> list[str] | None:
        image = node.next_node(nodes.image)
        name = images.get(Path(image["uri"]).name) if image is not None else None
        return writer.caption(node) if name is not None and shown_since_prose(name) else None

    writer = MarkdownWriter(link=page.link, attach=attach, figure=figure, number=page.number)

    def place_code(before_line: int | None = None, up_to: int | None = None) -> None:
        """Place the pending code cells that come before a line, or up to a cell index."""
        while pending and (
            (up_to is not None and pending[0] <= up_to)
            or (before_line is not None and start[pending[0]] < before_line)
        ):
            items.append(("code", pending.pop(0)))

    def walk(parent: nodes.Element, level: int) -> None:
        for child in parent.children:
            if isinstance(child, nodes.section):
                place_code(before_line=_line(child))
                title = next((c for c in child.children if isinstance(c, nodes.title)), None)
                if title is not None:
                    items.append(("heading", ["#" * min(level, 6) + " " + writer.text(title)]))
                walk(child, level + 1)
            elif isinstance(child, nodes.title):
                continue
            elif isinstance(child, nodes.Element) and child.get("nb_element") == "cell_code":
                place_code(up_to=child["cell_index"])
            else:
                place_code(before_line=_line(child))
                lines = writer.block(child)
                if lines:
                    items.append(("md", lines))

    walk(page.doctree, 1)
    place_code(up_to=max(cells, default=-1))

    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {
        k: v
        for k, v in page.executed.get("metadata", {}).items()
        if k in ("kernelspec", "language_info")
    }
    notebook.metadata["sdpa_book"] = {"page": page.docname, "export": EXPORT}
    out = [nbformat.from_dict({"cell_type": "markdown", "source": page.header, "metadata": {}})]
    markdown: list[str] = []

    def flush() -> None:
        if markdown:
            cell = nbformat.from_dict(
                {"cell_type": "markdown", "source": "\n".join(markdown), "metadata": {}}
            )
            names = sorted(set(re.findall(r"\(attachment:([^)\s]+)\)", cell.source)))
            if names:
                cell.attachments = {name: attachments[name] for name in names}
            out.append(cell)
            markdown.clear()

    for kind, value in items:
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
    if writer.citations:
        works = [f"- {escape(work)}" for work in writer.citations.values()]
        references = "\n".join(["## References", "", *works])
        out.append(
            nbformat.from_dict({"cell_type": "markdown", "source": references, "metadata": {}})
        )
    for n, cell in enumerate(out):  # stable ids: an unchanged page gives the same notebook
        cell["id"] = hashlib.sha1(f"{page.docname}\0{n}".encode()).hexdigest()[:12]
    notebook.cells = out
    nbformat.validate(notebook)
    return notebook


# --------------------------------------------------------------------------------------------
# Sphinx: which pages are notebooks, and their reader's notebooks.


def executed_notebook_path(app, docname: str) -> Path:
    # myst-nb writes executed notebooks to <outdir>/../jupyter_execute/<docname>.ipynb.
    return Path(app.outdir).parent / "jupyter_execute" / f"{docname}.ipynb"


def is_notebook(app, docname: str) -> bool:
    """True when myst-nb wrote this page as a notebook since its source last changed."""
    notebook = executed_notebook_path(app, docname)
    source = Path(app.env.doc2path(docname))
    return notebook.exists() and notebook.stat().st_mtime >= source.stat().st_mtime


def executed_notebook(app, docname: str) -> nbformat.NotebookNode:
    """The page's executed notebook as the execution cache holds it: every output, glue included.

    MyST-NB's own copy has no glue outputs and, when the page came from the cache, no outputs at
    all (it writes the notebook it read, not the one it merged with the cache). Without the cache
    (another ``nb_execution_mode``) that copy is all there is.
    """
    path = executed_notebook_path(app, docname)
    notebook = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    if app.config.nb_execution_mode != "cache" or not app.config.nb_execution_cache_path:
        return notebook
    from jupyter_cache import get_cache

    try:
        _, merged = get_cache(app.config.nb_execution_cache_path).merge_match_into_notebook(
            notebook, cell_meta=()
        )
    except KeyError:
        return notebook
    return merged


def _stored_glue(app, docname: str) -> dict:
    path = executed_notebook_path(app, docname).with_suffix(".glue.json")
    glue = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    for output in glue.values():
        data = output.get("data", {})
        for mime, value in data.items():
            if isinstance(value, list):  # multi-line values may be stored as lists of lines
                data[mime] = "".join(value)
    return glue


@functools.cache
def built_with() -> str:
    versions = [f"Python {'.'.join(map(str, sys.version_info[:3]))}"]
    for dist, name in [("sdpa", "sdpa"), ("numpy", "NumPy"), ("matplotlib", "Matplotlib")]:
        try:
            versions.append(f"{name} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(versions)


def _header(app, title: str) -> str:
    where = "the book"
    if RUN_PAGE in app.env.titles:
        where = f'the page "{app.env.titles[RUN_PAGE].astext()}" of the book'
    return "\n".join([
        f"> This notebook is the page **{escape(title)}** of *{escape(app.config.project)}*, "
        f"with the outputs of the run that built the book ({escape(built_with())}).",
        ">",
        f"> It runs in a plain Jupyter with `sdpa`, NumPy and Matplotlib installed: {escape(where)} "
        "says how. Cells the website hides start with a comment that says so, and are folded here.",
    ])  # fmt: skip


def write_reader_notebook(app, docname: str, doctree: nodes.document | None = None) -> Path:
    """Write the page's reader's notebook into ``_sources/`` (its resolved doctree if given)."""
    baseurl = app.config.sdpa_notebooks_baseurl or app.config.html_baseurl
    page_url = (
        urljoin(baseurl.rstrip("/") + "/", app.builder.get_target_uri(docname)) if baseurl else ""
    )
    numbers = app.env.toc_fignumbers.get(docname, {}).get("figure", {})

    def link(refuri: str) -> str | None:
        return urljoin(page_url, refuri) if page_url else None

    def image_path(image: nodes.image) -> Path | None:
        uri = image.get("candidates", {}).get("*", image.get("uri", ""))
        return None if not uri or _SCHEME.match(uri) else (Path(app.srcdir) / uri).resolve()

    def number(figure: nodes.figure) -> str | None:
        found = next((numbers[i] for i in figure["ids"] if i in numbers), None)
        if not app.config.numfig or found is None:
            return None
        return app.config.numfig_format["figure"] % ".".join(map(str, found))

    title = app.env.titles[docname].astext() if docname in app.env.titles else docname
    page = Page(
        docname=docname,
        doctree=doctree
        if doctree is not None
        else app.env.get_and_resolve_doctree(docname, app.builder),
        executed=executed_notebook(app, docname),
        glue=_stored_glue(app, docname),
        header=_header(app, title),
        link=link,
        image_path=image_path,
        number=number,
    )
    target = reader_notebook_path(app, docname)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(nbformat.writes(reader_notebook(page)) + "\n", encoding="utf-8")
    return target


def reader_notebook_path(app, docname: str) -> Path:
    return Path(app.outdir) / "_sources" / f"{docname}.ipynb"


def _is_current(app, docname: str) -> bool:
    """True when the page's reader's notebook was written by this file since its execution."""
    path = reader_notebook_path(app, docname)
    if (
        not path.exists()
        or path.stat().st_mtime < executed_notebook_path(app, docname).stat().st_mtime
    ):
        return False
    try:
        return (
            json.loads(path.read_text(encoding="utf-8"))["metadata"]["sdpa_book"]["export"]
            == EXPORT
        )
    except (ValueError, KeyError, TypeError):
        return False


def on_doctree_resolved(app, doctree, docname) -> None:
    """Write the reader's notebook of each page the html builder writes, from its doctree."""
    if app.builder.format == "html" and is_notebook(app, docname):
        write_reader_notebook(app, docname, doctree)


def offer_notebook(app, pagename, templatename, context, doctree) -> None:
    """Let the theme's download menu list the page's .ipynb (runs before the theme's hook)."""
    if doctree is not None and is_notebook(app, pagename):
        context["ipynb_source"] = f"{pagename}.ipynb"


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


# --------------------------------------------------------------------------------------------
# The package, its requirements and the archive, in the site.


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
    """Write the reader's notebooks, and the package, requirements and archive (build-finished)."""
    if exception or app.builder.format != "html":
        return
    started = time.perf_counter()
    outdir = Path(app.outdir)
    notebooks: dict[str, Path] = {}
    redone = 0
    for docname in sorted(app.env.found_docs):
        if is_notebook(app, docname):
            # Pages written in this build have theirs (on_doctree_resolved); the others keep
            # theirs unless it is missing or was written by another version of this file.
            if not _is_current(app, docname):
                write_reader_notebook(app, docname)
                redone += 1
            notebooks[docname] = reader_notebook_path(app, docname)

    version = _package_version(app)
    if version is None:
        return
    dist = Path(app.config.sdpa_dist_dir or Path(app.outdir).parent / "dist")
    wheel, sdist = dist / f"sdpa-{version}-py3-none-any.whl", dist / f"sdpa-{version}.tar.gz"
    missing = [path.name for path in (wheel, sdist) if not path.exists()]
    stale = [] if missing else stale_files(wheel, Path(app.confdir) / "src")
    if missing or stale:
        problem = (
            f"no {' and no '.join(missing)}" if missing else f"an older {', '.join(stale[:3])}"
        )
        logger.warning(
            "the site's downloads need the sdpa wheel and sdist of src/, but %s has %s: run "
            "`make html`, which builds them", dist, problem, type="sdpa", subtype="dist",
        )  # fmt: skip
        return
    downloads = outdir / DOWNLOADS
    shutil.rmtree(downloads, ignore_errors=True)
    downloads.mkdir(parents=True)
    for path in (wheel, sdist):
        shutil.copy2(path, downloads / path.name)
    requirements = requirements_text(wheel.name).encode("utf-8")
    (downloads / "requirements.txt").write_bytes(requirements)
    folder = f"sdpa-{version}-notebooks"
    files = {f"{folder}/{docname}.ipynb": path.read_bytes() for docname, path in notebooks.items()}
    files[f"{folder}/requirements.txt"] = requirements
    files[f"{folder}/{wheel.name}"] = wheel.read_bytes()
    _zip(downloads / _archive_name(app), files)
    logger.info(
        "sdpa_notebooks: %d reader's notebooks (%d redone here), the wheel and the archive in %.1f s",
        len(notebooks), redone, time.perf_counter() - started,
    )  # fmt: skip


def setup(app):
    app.add_config_value("sdpa_notebooks_baseurl", "", "html", types=frozenset({str}))
    app.add_config_value("sdpa_dist_dir", "", "html", types=frozenset({str}))
    app.connect("html-page-context", offer_notebook, priority=400)
    app.connect("html-page-context", link_run_page, priority=600)
    app.connect("doctree-resolved", on_doctree_resolved)
    app.connect("build-finished", write_downloads)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
