"""Jupyter Markdown from a resolved doctree: every role and directive reads as on the site.

:class:`MarkdownWriter` converts docutils nodes, not pages: glued numbers are already text in a
resolved doctree, cross-references are written as the title they point to (or as links, when
``link`` gives a URL), citations as on the page (the works cited are collected), maths as
``$...$``, admonitions as quotes, dropdowns as ``<details>``, tables as pipe tables, API entries
as their signature in code. Text is escaped so that Jupyter shows it as itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from docutils import nodes

ESCAPE = re.compile(r"([\\`*_\[\]<>$|~])")
LINE_START = re.compile(r"^(\s*)([#>+=-]|\d+[.)])")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
SKIP = (nodes.target, nodes.comment, nodes.substitution_definition, nodes.system_message,
        nodes.pending)  # fmt: skip
SKIP_TAGS = {"toctree", "index", "only", "meta", "tabular_col_spec"}
LANGUAGES = {"ipython3": "python", "ipython": "python", "default": "", "none": "",
             "myst-ansi": "", "text": ""}  # fmt: skip


def one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text)


def escape(text: str) -> str:
    """Text that Jupyter's Markdown shows as itself (no emphasis, maths, HTML or table cells)."""
    return ESCAPE.sub(r"\\\1", one_line(text))


def code_span(text: str) -> str:
    text = one_line(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def fenced(text: str, language: str = "") -> list[str]:
    fence = "`" * (max((len(run) for run in re.findall(r"`{3,}", text)), default=2) + 1)
    return [f"{fence}{language}", *text.rstrip("\n").split("\n"), fence]


def prefix(lines: list[str], first: str, rest: str) -> list[str]:
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


def none(node):
    return None


@dataclass
class MarkdownWriter:
    """Writes resolved docutils nodes as Jupyter Markdown.

    ``link(refuri)`` gives the URL of an internal reference, or ``None`` to write its text only;
    ``attach(image)`` the Markdown of an image; ``figure(node)`` the lines that replace a figure,
    or ``None`` to write it whole; ``number(figure)`` its number ("Fig. 2") or ``None``. The works
    cited are collected in ``citations`` (URL -> full reference).
    """

    link: Callable = none
    attach: Callable = lambda image: escape(image.get("alt", ""))  # noqa: E731
    figure: Callable = none
    number: Callable = none
    citations: dict[str, str] = field(default_factory=dict)

    # -- inline ---------------------------------------------------------------------------

    def text(self, node: nodes.Node) -> str:
        """The inline Markdown of a paragraph-like node, on one line."""
        return "".join(self.inline(child) for child in node.children).strip()

    def inline(self, node: nodes.Node) -> str:
        if isinstance(node, nodes.Text):
            return escape(node.astext())
        if isinstance(node, SKIP):
            return ""
        if isinstance(node, nodes.raw):
            return one_line(node.astext()) if node.get("format") == "html" else ""
        if isinstance(node, nodes.literal):
            return code_span(node.astext())
        if isinstance(node, nodes.math):
            return f"${one_line(node.astext().strip())}$"
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
        if SCHEME.match(refuri) and not node.get("internal"):
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

    def block(self, node: nodes.Node) -> list[str]:
        """One block node as lines: the first writer of ``BLOCK_WRITERS`` whose types match."""
        if isinstance(node, SKIP) or node.tagname in SKIP_TAGS:
            return []
        for types, write in self.BLOCK_WRITERS:
            if isinstance(node, types):
                return write(self, node)
        if node.tagname == "desc":  # before admonitions: Sphinx's desc is an Admonition
            return self._desc(node)
        if self._is_dropdown(node):
            return self._dropdown(node)
        if isinstance(node, (nodes.Admonition, nodes.topic, nodes.sidebar)):
            return self._admonition(node)
        if isinstance(node, nodes.TextElement):
            text = self.text(node)
            return [text] if text else []
        return self.blocks(node.children)

    def _text(self, node: nodes.Text) -> list[str]:
        text = escape(node.astext()).strip()
        return [text] if text else []

    def _paragraph(self, node: nodes.paragraph) -> list[str]:
        text = self.text(node)
        return [LINE_START.sub(r"\1\\\2", text)] if text else []

    def _title(self, node: nodes.Element) -> list[str]:
        return [f"**{self.text(node)}**"]

    def _math_block(self, node: nodes.math_block) -> list[str]:
        tex = node.astext().strip("\n").split("\n")
        if node.get("nowrap"):  # an environment of its own (amsmath): Jupyter typesets it as is
            return tex
        number = node.get("number")
        tag = [f"\\tag{{{number}}}"] if type(number) is int else []
        return ["$$", *tex, *tag, "$$"]

    def _literal_block(self, node: nodes.literal_block) -> list[str]:
        language = node.get("language", "")
        return fenced(node.astext(), LANGUAGES.get(language, language))

    def _doctest_block(self, node: nodes.doctest_block) -> list[str]:
        return fenced(node.astext(), "python")

    def _bullet_list(self, node: nodes.bullet_list) -> list[str]:
        return self._list(node, lambda i: "- ")

    def _enumerated_list(self, node: nodes.enumerated_list) -> list[str]:
        start = node.get("start", 1)
        return self._list(node, lambda i: f"{start + i}. ")

    def _list(self, node, marker) -> list[str]:
        items = [self.blocks(item.children) for item in node.children]
        loose = any("" in lines for lines in items)
        out: list[str] = []
        for i, lines in enumerate(items):
            mark = marker(i)
            out += [""] * (loose and bool(out)) + prefix(lines or [""], mark, " " * len(mark))
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
            out += prefix(lines, "- ", "  ")
        return out

    def _block_quote(self, node: nodes.block_quote) -> list[str]:
        return prefix(self.blocks(node.children), "> ", "> ")

    def _line_block(self, node: nodes.line_block) -> list[str]:
        lines = [self.text(line) for line in node.children if isinstance(line, nodes.line)]
        return ["<br>".join(lines)]

    def _transition(self, node: nodes.transition) -> list[str]:
        return ["---"]

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
        replaced = self.figure(figure)
        if replaced is not None:
            return replaced
        images = [self.attach(image) for image in figure.findall(nodes.image)]
        caption = self.caption(figure)
        return images + [""] * bool(images and caption) + caption

    def _image(self, node: nodes.image) -> list[str]:
        return [self.attach(node)]

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

    def _note(self, node: nodes.Element) -> list[str]:
        """A footnote or a citation: its label in brackets, its text indented below."""
        label = node.next_node(nodes.label)
        body = [c for c in node.children if not isinstance(c, nodes.label)]
        return prefix(self.blocks(body), f"[{label.astext() if label else ''}] ", "    ")

    def _raw(self, node: nodes.raw) -> list[str]:
        return node.astext().split("\n") if node.get("format") == "html" else []

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
                out += [""] * bool(out and lines) + prefix(lines, "> ", "> ")
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
        return prefix([f"**{heading}**", "", *self.blocks(body)], "> ", "> ")

    # In the order they are tried: the first whose types match the node writes it.
    BLOCK_WRITERS = (
        (nodes.Text, _text),
        (nodes.paragraph, _paragraph),
        ((nodes.title, nodes.rubric), _title),
        (nodes.math_block, _math_block),
        (nodes.literal_block, _literal_block),
        (nodes.doctest_block, _doctest_block),
        (nodes.bullet_list, _bullet_list),
        (nodes.enumerated_list, _enumerated_list),
        ((nodes.definition_list, nodes.field_list), _definitions),
        (nodes.block_quote, _block_quote),
        (nodes.line_block, _line_block),
        (nodes.transition, _transition),
        (nodes.figure, _figure),
        (nodes.image, _image),
        (nodes.table, _table),
        ((nodes.footnote, nodes.citation), _note),
        (nodes.raw, _raw),
    )
