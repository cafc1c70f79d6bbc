"""mkdocs hook: math as MathML and code highlighting CSS, both made at build time, offline.

Math is written ``$x$`` (inline) and ``$$ … $$`` (display) in the pages, and ``:math:`x``` /
``.. math::`` in docstrings (``docs/_hooks/griffe_pmlfunc.py`` turns those into the dollar
forms). ``pymdownx.arithmatex`` (``generic: true``) keeps the LaTeX in
``<span class="arithmatex">\\(…\\)</span>`` / ``<div class="arithmatex">\\[…\\]</div>``; this hook
replaces each by MathML from ``latex2mathml`` (pure Python), which browsers render natively (MathML
Core): no JavaScript and no fonts or scripts from a CDN. A formula ``latex2mathml`` cannot
convert fails the build.

The Pygments stylesheet for the highlighted code blocks (``pymdownx.highlight``) is generated
from the installed Pygments into ``assets/pygments.css``.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert
from mkdocs.structure.files import File

_ARITHMATEX = re.compile(
    r'<(span|div) class="arithmatex">\s*\\(\(|\[)(.*?)\\(\)|\])\s*</\1>', re.DOTALL
)
_TEXT_ARG = re.compile(r"\\(?:text|mathrm|textrm|operatorname)\{([^{}]*)\}")
CSS = ("assets/pygments.css", "assets/extra.css")
PYGMENTS_STYLE = "friendly"


_STATEMENT_GAP = re.compile(r",?\s*\\q?quad\s*$")
_LEADING_GAP = re.compile(r"^\\q?quad\b\s*")


def _depth(text: str) -> int:
    r"""Open ``{`` minus ``}`` (escaped ``\{``/``\}`` excluded)."""
    braces = re.sub(r"\\[{}]", "", text)
    return braces.count("{") - braces.count("}")


def _top_level_equals(row: str) -> int:
    depth = 0
    for i, ch in enumerate(row):
        if ch == "{" and (i == 0 or row[i - 1] != "\\"):
            depth += 1
        elif ch == "}" and (i == 0 or row[i - 1] != "\\"):
            depth -= 1
        elif ch == "=" and depth == 0:
            return i
    return -1


def aligned_rows(latex: str) -> str | None:
    r"""A display formula written over several source lines, as rows of ``align*``: a line that
    starts with ``+``, ``-`` or ``=`` continues the previous row's right-hand side, and a
    ``\quad``/``\qquad`` at a line break separates two statements (rows aligned at their
    ``=``). Browsers do not break long MathML lines; without this a formula such as VICReg's is
    wider than the page. None when the formula stays one row (or has its own layout)."""
    if "\\begin" in latex or "\\\\" in latex or "&" in latex:
        return None
    lines = [line.strip() for line in latex.strip().split("\n") if line.strip()]
    rows: list[tuple[str, str]] = [("statement", lines[0])]
    for line in lines[1:]:
        kind, text = rows[-1]
        if _depth("".join(r for _, r in rows)) != 0:
            rows[-1] = (kind, f"{text} {line}")
        elif line[0] in "+-=" and len(line) > 16:  # a short tail ("+ \epsilon\Big)") stays
            rows.append(("continuation", line))
        elif _LEADING_GAP.match(line) or _STATEMENT_GAP.search(text):
            gap = _STATEMENT_GAP.search(text)
            if gap:
                rows[-1] = (
                    kind,
                    text[: gap.start()] + ("," if gap.group(0).startswith(",") else ""),
                )
            rows.append(("statement", _LEADING_GAP.sub("", line)))
        else:
            rows[-1] = (kind, f"{text} {line}")
    if len(rows) < 2:
        return None
    out = []
    for kind, row in rows:
        if kind == "continuation":
            out.append(f"&{row}" if row.startswith("=") else f"&\\quad {row}")
        else:
            eq = _top_level_equals(row)
            split = eq > 0 and not row.startswith("(")  # "(J = 0 when ...)" is a remark
            out.append(f"{row[:eq]}&{row[eq:]}" if split else f"&{row}")
    return "\\begin{align*}" + " \\\\ ".join(out) + "\\end{align*}"


def _prepare(latex: str, display: bool) -> str:
    # latex2mathml keeps "\_" verbatim inside \text{...}; LaTeX prints an underscore.
    latex = _TEXT_ARG.sub(lambda m: m.group(0).replace(r"\_", "_"), latex)
    if display:
        latex = aligned_rows(latex) or latex
    return latex.strip()


_PLAIN_FENCE = re.compile(
    r"<mo>(&#x02016;|&#x0007C;|\||‖|&#x0230A;|&#x0230B;|&#x02308;|&#x02309;|&#x027E8;|&#x027E9;"
    r"|⌊|⌋|⌈|⌉|⟨|⟩|\{|\}|&#x0007B;|&#x0007D;)</mo>"
)
_ESCAPED_DELIMITER = re.compile(r"(<mo\b[^>]*>)\\([{}|])(</mo>)")


def _polish(mathml: str) -> str:
    # MathML Core has no named spaces; a thin negative space is -3/18 em.
    mathml = mathml.replace('width="negativethinmathspace"', 'width="-0.167em"')
    # latex2mathml keeps the backslash of sized delimiters (\big\{ gives <mo ...>\{</mo>).
    mathml = _ESCAPED_DELIMITER.sub(r"\1\2\3", mathml)
    # A delimiter written without \left, \right or \big keeps its size in LaTeX; MathML Core
    # would stretch a bare <mo> fence (a ‖x‖ inside a fraction grows to the fraction's height).
    return _PLAIN_FENCE.sub(r'<mo stretchy="false">\1</mo>', mathml)


def to_mathml(latex: str, display: bool) -> str:
    """The MathML of one formula (``ValueError`` naming the formula if it cannot be converted)."""
    try:
        out = convert(_prepare(latex, display), display="block" if display else "inline")
    except Exception as e:  # latex2mathml raises several exception types
        raise ValueError(f"cannot convert the formula {latex!r} to MathML: {e}") from e
    # The LaTeX stays with the formula, for screen readers and copy-paste (``alttext``).
    alt = html.escape(" ".join(latex.split()), quote=True)
    return _polish(out).replace("<math ", f'<math alttext="{alt}" ', 1)


def mathml_html(content: str) -> str:
    def sub(m: re.Match) -> str:
        display = m.group(2) == "["
        latex = html.unescape(m.group(3))
        math = to_mathml(latex, display)
        if display:
            return f'<div class="math-display">{math}</div>'
        return math

    return _ARITHMATEX.sub(sub, content)


def on_config(config):
    for css in CSS:
        if css not in config.extra_css:
            config.extra_css.append(css)
    return config


def on_files(files, config):
    from pygments.formatters import HtmlFormatter

    css = HtmlFormatter(style=PYGMENTS_STYLE).get_style_defs(".highlight")
    files.append(File.generated(config, CSS[0], content=css))
    return files


def on_page_content(html_text, page, config, files):
    return mathml_html(html_text)
