"""The bibliography links back to every place that cites each work.

sphinxcontrib-bibtex lists the works cited in the book on the bibliography page, and each
citation in the text links there; this extension adds the way back: under each entry, "Cited
in" and a link to its first citation on each page that cites it, named by the page's title, in
the book's order. The
bibliography page is re-read on every build, so a citation added to another page shows up
without a forced rebuild.
"""

from __future__ import annotations

from docutils import nodes

BIBLIOGRAPHY = "appendix/bibliography"


def bibliography_is_always_outdated(app, env, added, changed, removed) -> list[str]:
    """Re-read the bibliography page on every build (it is one short page)."""
    return [BIBLIOGRAPHY] if BIBLIOGRAPHY in env.found_docs else []


def citing_places(env) -> dict[str, list[tuple[str, str]]]:
    """``key -> [(docname, citation reference id), ...]``: the first citation of the work on
    each page that cites it, in the order of the book's pages."""
    domain = env.get_domain("cite")
    order = {name: i for i, name in enumerate(env.toctree_includes.get("index", []))}
    refs = sorted(domain.citation_refs, key=lambda r: (order.get(r.docname, len(order)), r.line))
    places: dict[str, list[tuple[str, str]]] = {}
    for ref in refs:
        for target in ref.targets:
            cited = places.setdefault(target.key, [])
            if ref.docname not in (where for where, _ in cited):  # the first on each page
                cited.append((ref.docname, ref.citation_ref_id))
    return places


def backlinks(app, doctree, docname: str) -> None:
    """Under each entry of the bibliography, a "Cited in" line with a link per citation."""
    if docname != BIBLIOGRAPHY:
        return
    env = app.builder.env
    key_of = {c.citation_id: c.key for c in env.get_domain("cite").citations}
    places = citing_places(env)
    for citation in doctree.findall(nodes.citation):
        key = next((key_of[i] for i in citation["ids"] if i in key_of), None)
        cited = places.get(key, [])
        if not cited:
            continue
        line = nodes.paragraph(classes=["sdpa-cited-in"])
        line += nodes.Text("Cited in: ")
        for n, (where, ref_id) in enumerate(cited):
            if n:
                line += nodes.Text(", ")
            uri = app.builder.get_relative_uri(docname, where) + "#" + ref_id
            title = env.titles[where].astext() if where in env.titles else where
            line += nodes.reference("", title, refuri=uri, internal=True)
        citation += line


def setup(app):
    app.connect("env-get-outdated", bibliography_is_always_outdated)
    app.connect("doctree-resolved", backlinks)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
