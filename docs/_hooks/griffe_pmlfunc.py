"""griffe extension for the API pages (docs tooling only; the library is not changed).

1. ``pmlfunc.nn`` builds its module classes at import time (``ArcFace = _module(...)``), which
   static analysis sees as plain attributes. That one module is imported and those attributes are
   replaced by the inspected classes; every other module stays statically analysed (global
   ``force_inspection`` would also document each module's imports).
2. The docstrings are Google style with two RST constructs Markdown does not know: ``.. math::``
   blocks become fenced ``text`` blocks (LaTeX source, readable offline, no MathJax), and roles
   such as :func:`pmlfunc.losses.contrastive` become inline code, linked when the target is a
   fully qualified ``pmlfunc.`` name.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import griffe

_NN = "pmlfunc.nn"
_MATH = re.compile(r"^([ \t]*)\.\. math::[ \t]*\n((?:\1[ \t]+\S.*\n?|[ \t]*\n)+)", re.MULTILINE)
_ROLE = re.compile(r":(?:func|meth|mod|class|attr|data|obj|exc):`~?([^`]+)`")


def _math(m: re.Match) -> str:
    indent, body = m.group(1), textwrap.dedent(m.group(2)).strip("\n")
    block = "\n".join(["```text", body, "```"])
    return "\n" + textwrap.indent(block, indent, lambda _: True) + "\n\n"


def _role(m: re.Match) -> str:
    target = m.group(1)
    if target.startswith("pmlfunc."):
        return f"[`{target}`][{target}]"
    return f"`{target}`"


def rst_to_markdown(text: str) -> str:
    return _ROLE.sub(_role, _MATH.sub(_math, text))


class PmlfuncDocs(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)

    def on_module_members(self, *, mod: griffe.Module, **kwargs) -> None:
        if mod.path != _NN:
            return
        root = str(Path(mod.filepath).parents[1])  # the directory holding the pmlfunc package
        inspected = griffe.inspect(
            mod.name, filepath=mod.filepath, parent=mod.parent, import_paths=[root, *sys.path]
        )
        for name, member in inspected.members.items():
            static = mod.members.get(name)
            # Aliases (imports) are skipped without resolving them; only names that static
            # analysis saw as attributes but that are classes at run time are replaced.
            if isinstance(member, griffe.Alias) or isinstance(static, griffe.Alias):
                continue
            if static is not None and static.is_attribute and member.is_class:
                for obj in (member, *member.all_members.values()):
                    if not isinstance(obj, griffe.Alias) and obj.docstring is not None:
                        obj.docstring.value = rst_to_markdown(obj.docstring.value)
                mod.set_member(name, member)
