"""griffe extension for the API pages (docs tooling only; the library is not changed).

1. ``pmlfunc.nn`` builds its module classes at import time (``ArcFace = _module(...)``), which
   static analysis sees as plain attributes. That one module is imported and those attributes are
   replaced by the inspected classes; every other module stays statically analysed (global
   ``force_inspection`` would also document each module's imports).
2. The docstrings are Google style with a few RST constructs Markdown does not know, rewritten in
   griffe's copy of each docstring (the doctests read the real ``__doc__``, unchanged):

   - ``.. math::`` blocks become ``$$ … $$`` and ``:math:`x``` roles become ``$x$``, which
     ``pymdownx.arithmatex`` keeps as LaTeX and ``docs/_hooks/mathml.py`` turns into MathML at
     build time (no JavaScript, nothing fetched);
   - runs of ``>>>`` lines (doctest examples, with their output lines) become fenced ``pycon``
     blocks, so that they keep their prompts and line breaks and are highlighted by Pygments;
   - RST literal blocks (a paragraph ending in ``::`` followed by an indented block) become
     fenced blocks (``python`` when the block parses as Python, else ``text``);
   - roles such as :func:`pmlfunc.losses.contrastive` become inline code, linked when the target
     is a fully qualified ``pmlfunc.`` name.
3. Parameter tables: an Args entry naming several parameters (``ref_emb, ref_labels: ...``) is
   split into one entry per name (each gets its own row, type and default from the signature),
   and a documented name that is not in the signature but is one of the keys of a
   ``**inputs: Unpack[SomeTypedDict]`` gets that key's real default (``None``: absent) instead
   of being shown as *required*.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

import griffe

_NN = "pmlfunc.nn"
_MATH = re.compile(r"^([ \t]*)\.\. math::[ \t]*\n((?:\1[ \t]+\S.*\n?|[ \t]*\n)+)", re.MULTILINE)
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_ROLE = re.compile(r":(?:func|meth|mod|class|attr|data|obj|exc):`~?([^`]+)`")
_PROMPT = re.compile(r"^([ \t]*)>>> ")
_SECTION = re.compile(r"^[ \t]*[A-Z][A-Za-z ]*:[ \t]*$")  # a Google section title ("Example:")
_ARGS_TITLE = re.compile(
    r"^([ \t]*)(?:Args|Arguments|Parameters|Keyword Args|Other Parameters):\s*$"
)
_GROUPED = re.compile(r"^([ \t]+)(\w+(?:,[ \t]*\**\w+)+)([ \t]*\([^)]*\))?:(?:[ \t]+|$)(.*)$")
# The defaults of keys of the shared inputs that are not "absent" (None). Kept in step with
# pmlfunc.losses._batch.regularized by tests/test_docs_html.py.
INPUT_DEFAULTS = {"embedding_reg_weight": "1.0"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _math(m: re.Match) -> str:
    indent, body = m.group(1), textwrap.dedent(m.group(2)).strip("\n")
    block = "\n".join(["$$", body, "$$"])
    return "\n" + textwrap.indent(block, indent, lambda _: True) + "\n\n"


def _role(m: re.Match) -> str:
    target = m.group(1)
    if target.startswith("pmlfunc."):
        return f"[`{target}`][{target}]"
    return f"`{target}`"


def _fence(lines: list[str], lang: str, indent: str) -> list[str]:
    body = textwrap.dedent("\n".join(lines)).split("\n")
    return [f"{indent}```{lang}", *(f"{indent}{b}" if b else "" for b in body), f"{indent}```"]


def _fence_indent(out: list[str], own: int) -> tuple[str, bool]:
    """Where a block indented by ``own`` goes: at its own indentation inside a Google section
    (the previous line is the section's title), else at the enclosing paragraph's indentation
    (a deeper indentation would make Markdown read the fence itself as an indented code
    block). Also whether a blank line must separate it from the preceding paragraph."""
    prev = next((line for line in reversed(out) if line.strip()), None)
    if prev is None or _SECTION.match(prev) or _indent(prev) >= own:
        return " " * own, bool(out and out[-1].strip() and not _SECTION.match(out[-1]))
    return " " * _indent(prev), bool(out and out[-1].strip())


def _code_blocks(text: str) -> str:
    """Runs of ``>>>`` lines (with their ``...`` continuations and output, up to a blank line
    or a dedent) and RST ``::`` literal blocks become fenced Markdown code blocks."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else _PROMPT.match(line)
        if m:
            own = len(m.group(1))
            j = i + 1
            while j < len(lines) and lines[j].strip() and _indent(lines[j]) >= own:
                j += 1
            indent, blank = _fence_indent(out, own)
            out += [""] * blank + _fence(lines[i:j], "pycon", indent) + [""]
            i = j
            continue
        if not in_fence and line.rstrip().endswith("::") and not line.strip().startswith(".."):
            # An RST literal block: blank line(s), then lines indented deeper than this one.
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            own = _indent(line)
            if j > i + 1 and j < len(lines) and _indent(lines[j]) > own:
                k = j
                while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > own):
                    k += 1
                while not lines[k - 1].strip():
                    k -= 1
                block = lines[j:k]
                try:
                    ast.parse(textwrap.dedent("\n".join(block)))
                    lang = "python"
                except SyntaxError:
                    lang = "text"
                head = line.rstrip()[:-1]  # "text::" -> "text:"; a lone "::" disappears
                out += [head if head.strip() != ":" else "", ""]
                out += [*_fence(block, lang, " " * own), ""]
                i = k
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _split_grouped_args(text: str) -> str:
    """``ref_emb, ref_labels: desc`` in an Args section becomes one entry per name, each with
    the whole description."""
    lines = text.split("\n")
    out: list[str] = []
    section_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        title = _ARGS_TITLE.match(line)
        if title:
            section_indent = len(title.group(1))
            out.append(line)
            i += 1
            continue
        if section_indent is not None and line.strip() and _indent(line) <= section_indent:
            section_indent = None
        m = _GROUPED.match(line) if section_indent is not None else None
        if m:
            indent, names, annotation, first = m.groups()
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > len(indent)):
                j += 1
            while j > i + 1 and not lines[j - 1].strip():
                j -= 1
            rest = lines[i + 1 : j]
            for name in (n.strip() for n in names.split(",")):
                out.append(f"{indent}{name}{annotation or ''}: {first}".rstrip())
                out += rest
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def rst_to_markdown(text: str) -> str:
    text = _split_grouped_args(text)
    text = _MATH.sub(_math, text)
    text = _MATH_ROLE.sub(lambda m: f"${m.group(1)}$", text)
    text = _code_blocks(text)
    return _ROLE.sub(_role, text)


def _typed_dict_keys(func: griffe.Function) -> set[str]:
    """The keys of ``**kwargs: Unpack[TD]`` (TD a TypedDict the loader can resolve)."""
    for p in func.parameters:
        if p.kind is not griffe.ParameterKind.var_keyword or p.annotation is None:
            continue
        ann = p.annotation
        if isinstance(ann, griffe.ExprSubscript) and ann.canonical_name == "Unpack":
            target = ann.slice
            try:
                td = func.modules_collection[target.canonical_path]  # type: ignore[union-attr]
            except (KeyError, AttributeError, griffe.AliasResolutionError):
                continue
            return {name for name, m in td.all_members.items() if m.is_attribute}
    return set()


def fix_parameter_defaults(func: griffe.Function) -> None:
    """Documented parameters that are keys of the function's ``**inputs: Unpack[TD]`` get their
    real default (absent: ``None``) instead of none at all (which renders as *required*)."""
    if func.docstring is None:
        return
    keys = None
    for section in func.docstring.parsed:
        if section.kind is not griffe.DocstringSectionKind.parameters:
            continue
        for param in section.value:
            if param.name in func.parameters or param.value is not None:
                continue
            if keys is None:
                keys = _typed_dict_keys(func)
            if param.name in keys:
                param.value = INPUT_DEFAULTS.get(param.name, "None")


class PmlfuncDocs(griffe.Extension):
    def __init__(self) -> None:
        self._functions: list[griffe.Function] = []

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
        if isinstance(obj, griffe.Function):
            self._functions.append(obj)

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        # Once the whole package is loaded (TypedDicts of other modules can be resolved).
        for func in self._functions:
            if func.package is pkg:
                fix_parameter_defaults(func)

    def on_module_members(self, *, mod: griffe.Module, **kwargs) -> None:
        if mod.path != _NN:
            return
        filepath, parent = mod.filepath, mod.parent
        assert isinstance(filepath, Path) and isinstance(parent, griffe.Module)  # a module file
        root = str(filepath.parents[1])  # the directory holding the pmlfunc package
        inspected = griffe.inspect(
            mod.name, filepath=filepath, parent=parent, import_paths=[root, *sys.path]
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
