"""The API page, generated from the modules' ``__all__``.

* ``.. autoall:: sdpa`` writes a summary table of every name in the module's ``__all__``, then
  an entry for each: ``autofunction``, or ``autoclass`` with its members and ``__call__``. A name
  added to ``__all__`` appears without anyone editing the page.
* Every other module is documented with ``.. automodule:: name`` and ``:members:``, which autodoc
  takes from the module's ``__all__``. A name that the package face (``sdpa_api_package``,
  ``sdpa``) re-exports is documented there, once: ``automodule`` skips it elsewhere.
* Autosummary's signatures wrap between arguments, never inside a name.
"""

from __future__ import annotations

import importlib
import inspect

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.parsing import nested_parse_to_nodes


def all_entries(module_name: str) -> list[str]:
    """reStructuredText: a summary table, then one autodoc entry per name in ``__all__``."""
    module = importlib.import_module(module_name)
    names = list(module.__all__)
    lines = [f".. currentmodule:: {module_name}", "", ".. autosummary::", ""]
    lines += [f"   {name}" for name in names]
    for name in names:
        if inspect.isclass(getattr(module, name)):
            lines += ["", f".. autoclass:: {module_name}.{name}", "   :members:"]
            lines += ["   :special-members: __call__"]
        else:
            lines += ["", f".. autofunction:: {module_name}.{name}"]
    return lines


class AutoAll(SphinxDirective):
    """``.. autoall:: module``: the module's ``__all__`` as a summary table and entries."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        try:
            lines = all_entries(name)
        except (ImportError, AttributeError) as error:
            raise self.error(f"autoall: cannot list {name}.__all__: {error}") from error
        return nested_parse_to_nodes(self.state, StringList(lines, f"<autoall {name}>"))


def skip_reexported(app, what, name, obj, skip, options) -> bool | None:
    """Skip a module's member that the package face exports: it is documented there."""
    if what != "module" or skip:
        return None
    face = importlib.import_module(app.config.sdpa_api_package)
    if any(obj is getattr(face, exported, None) for exported in face.__all__):
        return True
    return None


def break_autosummary_signatures(app, doctree, docname) -> None:
    """Let the API summary's signatures wrap between arguments, not inside a name.

    Autosummary's HTML visitor turns every space of the first column's text into a no-break
    space, so a signature becomes one long word that a narrow column can only split
    mid-identifier ("h / ead_dim"). It rewrites only the paragraph's own text nodes: wrapped in
    an inline node, the text keeps its spaces.
    """
    for table in doctree.findall(nodes.table):
        # autosummary writes its classes as one string: "autosummary longtable"
        if "autosummary" not in " ".join(table.get("classes", [])).split():
            continue
        for paragraph in table.findall(nodes.paragraph):
            for i, child in enumerate(list(paragraph.children)):
                if isinstance(child, nodes.Text) and " " in child:
                    paragraph[i] = nodes.inline("", "", nodes.Text(str(child)))


def setup(app):
    app.setup_extension("sphinx.ext.autodoc")
    app.setup_extension("sphinx.ext.autosummary")
    app.add_config_value("sdpa_api_package", "sdpa", "env", types=frozenset({str}))
    app.add_directive("autoall", AutoAll)
    app.connect("autodoc-skip-member", skip_reexported)
    app.connect("doctree-resolved", break_autosummary_signatures)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
