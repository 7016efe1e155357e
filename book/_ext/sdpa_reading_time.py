"""Reading times on the landing page, computed from the pages themselves.

A page writes ``[[minutes:formula/softmax]]`` where it wants the reading time of that page
(``8 min``): its prose at ``WORDS_PER_MINUTE``, and the code a reader sees at half that speed;
hidden cells, directives' options, front matter and labels do not count. The landing page shows
every page's time, so it is re-read whenever any page changed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

WORDS_PER_MINUTE = 200  # prose; code a reader reads counts at half speed
READING_TIME = re.compile(r"\[\[minutes:([\w/.-]+)\]\]")
CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
HIDDEN = re.compile(r"^:tags:.*\b(remove-cell|remove-input|hide-cell|hide-input)\b", re.M)


def reading_minutes(text: str) -> int:
    """Minutes to read a MyST page: its prose and visible code, hidden cells and markup excluded."""
    words = 0.0
    for match in CODE_CELL.finditer(text):
        body = match.group(1)
        if HIDDEN.search(body):
            continue
        code = [line for line in body.splitlines() if line.strip() and not line.startswith(":")]
        words += 0.5 * sum(len(line.split()) for line in code)
    prose = CODE_CELL.sub("", text)
    prose = re.sub(r"\A---\n.*?\n---\n", "", prose, flags=re.S)  # front matter
    prose = re.sub(r"^(:{3,}|`{3,}).*$|^:\w[\w-]*:.*$|^%.*$|^\(.*\)=$", "", prose, flags=re.M)
    prose = re.sub(r"\{[\w:-]+\}`([^`<]*)(<[^>]*>)?`", r"\1", prose)  # roles: keep their text
    words += len(re.findall(r"[A-Za-z0-9]+(?:[-'][A-Za-z0-9]+)*", prose))
    return max(1, math.ceil(words / WORDS_PER_MINUTE))


def write_reading_times(app, docname, source) -> None:
    """Replace ``[[minutes:docname]]`` by the reading time of that page, e.g. ``8 min``."""

    def minutes(match) -> str:
        path = Path(app.srcdir) / f"{match.group(1)}.md"
        return f"{reading_minutes(path.read_text(encoding='utf-8'))} min"

    if "[[minutes:" in source[0]:
        source[0] = READING_TIME.sub(minutes, source[0])


def landing_page_is_always_outdated(app, env, added, changed, removed) -> list[str]:
    """The landing page shows every page's reading time: re-read it whenever a page changed."""
    return ["index"] if (added or changed or removed) and "index" not in changed else []


def setup(app):
    app.connect("source-read", write_reading_times)
    app.connect("env-get-outdated", landing_page_is_always_outdated)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
