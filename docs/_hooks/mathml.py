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


def _prepare(latex: str) -> str:
    # latex2mathml keeps "\_" verbatim inside \text{...}; LaTeX prints an underscore.
    latex = _TEXT_ARG.sub(lambda m: m.group(0).replace(r"\_", "_"), latex)
    return latex.strip()


_ESCAPED_DELIMITER = re.compile(r"(<mo\b[^>]*>)\\([{}|])(</mo>)")


def _polish(mathml: str) -> str:
    # MathML Core has no named spaces; a thin negative space is -3/18 em.
    mathml = mathml.replace('width="negativethinmathspace"', 'width="-0.167em"')
    # latex2mathml keeps the backslash of sized delimiters (\big\{ gives <mo ...>\{</mo>).
    return _ESCAPED_DELIMITER.sub(r"\1\2\3", mathml)


def to_mathml(latex: str, display: bool) -> str:
    """The MathML of one formula (``ValueError`` naming the formula if it cannot be converted)."""
    try:
        out = convert(_prepare(latex), display="block" if display else "inline")
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
