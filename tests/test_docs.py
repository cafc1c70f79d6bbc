"""The documentation site builds offline with ``mkdocs build --strict`` (every warning fails it:
broken links and anchors, docstrings griffe cannot parse, API objects that cannot be found), and
the built HTML says what the docstrings say: formulas typeset as MathML, examples as code blocks
with their ``>>>`` prompts, one parameter-table row per parameter with its real default.

The site is built once per test session (``site`` fixture) and every HTML check reads that build.
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "_hooks"


def _needs_docs_tools() -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip(
        "mkdocstrings_handlers.python",
        reason="mkdocstrings[python] is not installed (pip install -e '.[docs]')",
    )
    pytest.importorskip(
        "latex2mathml", reason="latex2mathml is not installed (pip install -e '.[docs]')"
    )


@pytest.fixture(scope="session")
def build(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    _needs_docs_tools()
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, site


@pytest.fixture(scope="session")
def site(build) -> Path:
    result, path = build
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{result.stderr[-6000:]}")
    return path


def test_mkdocs_build_strict(build):
    result, site = build
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    assert (site / "api" / "losses" / "index.html").is_file()


# --- helpers reading the built HTML ----------------------------------------------------------

_TAG = re.compile(r"<[^>]+>")
_HEADING = re.compile(r'<h[1-6] id="(pmlfunc(?:\.\w+)*)" class="doc doc-heading">')


def _text(fragment: str) -> str:
    return html.unescape(_TAG.sub("", fragment))


def _main(page: str) -> str:
    """The page's content column (without the navigation, scripts and the search index)."""
    start = page.find('role="main"')
    end = page.find("<footer", start)
    return page[max(start, 0) : end if end > start else len(page)]


def _prose(page: str) -> str:
    """The text a reader sees outside code, math and the API signatures."""
    body = _main(page)
    for element in ("pre", "code", "math", "script", "style"):
        body = re.sub(rf"<{element}\b.*?</{element}>", " ", body, flags=re.DOTALL)
    return _text(body)


def _sections(page: str) -> dict[str, str]:
    """Each documented object's HTML, from its heading to the next object's heading."""
    found = list(_HEADING.finditer(page))
    return {
        m.group(1): page[m.end() : found[k + 1].start() if k + 1 < len(found) else len(page)]
        for k, m in enumerate(found)
    }


def _resolve(path: str):
    """The object named by a heading id (``pmlfunc.losses.triplet_margin``), or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def _api_pages(site: Path) -> list[Path]:
    pages = sorted((site / "api").glob("*/index.html"))
    assert len(pages) >= 10, pages
    return pages


def _parameter_rows(section: str) -> list[tuple[str, str]]:
    """``(name, default)`` of every row of the section's "Parameters:" tables."""
    rows = []
    for table in re.findall(
        r'<span class="doc-section-title">Parameters:</span></p>\s*<table>(.*?)</table>',
        section,
        flags=re.DOTALL,
    ):
        header = [_text(h).strip() for h in re.findall(r"<th>(.*?)</th>", table, re.DOTALL)]
        for row in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', table, re.DOTALL):
            cells = [_text(c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.DOTALL)]
            record = dict(zip(header, cells, strict=True))
            rows.append((record["Name"], record.get("Default", "")))
    return rows


# --- math --------------------------------------------------------------------------------------

_LATEX = re.compile(r"\\(?:[a-zA-Z]{2,}|[,;!{}\[\]()])")


def test_no_raw_latex_left_in_any_page(site):
    offenders = {}
    for page in sorted(site.rglob("*.html")):
        text = _prose(page.read_text(encoding="utf-8"))
        hits = sorted(set(_LATEX.findall(text)))
        if hits:
            offenders[str(page.relative_to(site))] = hits[:8]
    assert not offenders, f"raw LaTeX in the text of: {offenders}"


def _math_blocks(doc: str | None) -> int:
    return len(re.findall(r"^\s*\.\. math::", doc or "", flags=re.MULTILINE))


def test_every_docstring_formula_is_mathml_on_the_losses_page(site):
    page = (site / "api" / "losses" / "index.html").read_text(encoding="utf-8")
    sections = _sections(page)
    expected_total = 0
    for path, section in sections.items():
        obj = _resolve(path)
        if obj is None or inspect.ismodule(obj):
            continue
        want = _math_blocks(obj.__doc__)
        expected_total += want
        got = len(re.findall(r'<math alttext="[^"]*" xmlns="[^"]+" display="block"', section))
        assert got == want, f"{path}: {want} formula(s) in the docstring, {got} display MathML"
    assert expected_total >= 20  # the losses' docstrings are full of formulas


def test_every_docstring_formula_converts_to_mathml():
    """Every ``.. math::`` block of the package converts (the build would fail on one that does
    not; this names it) and the result is well-formed MathML with its LaTeX as ``alttext``."""
    pytest.importorskip("latex2mathml")
    import xml.etree.ElementTree as ET

    sys.path.insert(0, str(HOOKS))
    try:
        import griffe_pmlfunc
        import mathml
    finally:
        sys.path.remove(str(HOOKS))
    formulas = []
    for path in sorted((ROOT / "pmlfunc").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for m in griffe_pmlfunc._MATH.finditer(text):
            formulas.append((path.name, inspect.cleandoc(m.group(2))))
    assert len(formulas) >= 40
    for name, latex in formulas:
        out = mathml.to_mathml(latex, display=True)
        root = ET.fromstring(out)
        assert root.tag == "{http://www.w3.org/1998/Math/MathML}math", name
        assert root.get("display") == "block"
        assert "\\" not in "".join(root.itertext()), f"{name}: LaTeX left in {latex!r}: {out}"


def test_inline_dollar_math_in_a_markdown_page_is_mathml(site):
    page = (site / "contributing" / "index.html").read_text(encoding="utf-8")
    inline = re.findall(r'<math alttext="([^"]*)"[^>]*display="inline"', page)
    assert inline == [html.escape(r"\ell_a = \log(1 + e^{x_a})", quote=True)]


def test_inline_and_display_dollar_math_in_pages_become_mathml():
    """The Markdown pages' syntax (``$x$``, ``$$…$$`` via pymdownx.arithmatex) goes through the
    same converter: a page fragment as arithmatex writes it becomes MathML."""
    pytest.importorskip("latex2mathml")
    sys.path.insert(0, str(HOOKS))
    try:
        import mathml
    finally:
        sys.path.remove(str(HOOKS))
    fragment = (
        '<p>with <span class="arithmatex">\\(\\tau &lt; 1\\)</span> and</p>\n'
        '<div class="arithmatex">\\[\\ell = \\frac{1}{N}\\sum_i x_i\\]</div>'
    )
    out = mathml.mathml_html(fragment)
    assert "arithmatex" not in out and "\\frac" not in _TAG.sub("", out)
    assert out.count("<math ") == 2 and 'display="inline"' in out and 'display="block"' in out
    assert "<mo>&#x0003C;</mo>" in out or "<mo>&lt;</mo>" in out  # "<" arrives as an operator


# --- examples ----------------------------------------------------------------------------------


def _doctest_lines(doc: str) -> list[str]:
    """The source and output lines of the docstring's ``>>>`` examples, dedented."""
    lines = (doc or "").split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)>>> ", lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        while (
            i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) >= indent
        ):
            out.append(lines[i][indent:].rstrip())
            i += 1
    return out


def _pycon_lines(section: str) -> list[str]:
    out = []
    for block in re.findall(
        r'<div class="language-pycon highlight"><pre>.*?<code>(.*?)</code></pre>',
        section,
        re.DOTALL,
    ):
        out += [line.rstrip() for line in _text(block).rstrip("\n").split("\n")]
    return out


def test_docstring_examples_are_code_blocks_with_their_prompts(site):
    checked = 0
    for page in _api_pages(site):
        sections = _sections(page.read_text(encoding="utf-8"))
        for path, section in sections.items():
            if "doc-attribute-name" in section.split("</h", 1)[0]:
                continue  # an alias (``sphereface_init = large_margin_softmax_init``): no docstring
            obj = _resolve(path)
            doc = inspect.getdoc(obj) if obj is not None and not inspect.ismodule(obj) else None
            if obj is not None and inspect.ismodule(obj):
                doc = obj.__doc__
            want = _doctest_lines(doc or "")
            if not want:
                continue
            # A class section also holds its members' sections: compare its own blocks only.
            own = section.split('<div class="doc doc-children">', 1)[0]
            got = _pycon_lines(own)
            assert got == want, f"{path} on {page.parent.name}: the example differs"
            assert all("&gt;&gt;&gt;" not in line for line in got)
            checked += 1
    assert checked >= 60, checked


# --- parameter tables --------------------------------------------------------------------------


def test_parameter_tables_have_one_row_per_parameter_and_true_defaults(site):
    checked = 0
    for page in _api_pages(site):
        for path, section in _sections(page.read_text(encoding="utf-8")).items():
            own = section.split('<div class="doc doc-children">', 1)[0]
            rows = _parameter_rows(own)
            if not rows:
                continue
            obj = _resolve(path)
            if inspect.isclass(obj):
                obj = obj.__init__
            assert obj is not None and callable(obj), path
            params = inspect.signature(obj).parameters
            for name, default in rows:
                assert "," not in name, f"{path}: one row for several parameters: {name!r}"
                bare = name.lstrip("*")
                if default != "required":
                    continue
                assert bare in params, f"{path}: {name} listed as required but not a parameter"
                p = params[bare]
                assert p.default is inspect.Parameter.empty, (
                    f"{path}: {name} listed as required but defaults to {p.default!r}"
                )
                assert p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD), f"{path}: {name}"
                checked += 1
    assert checked >= 50, checked


def test_a_returns_section_is_one_row_not_one_row_per_wrapped_line(site):
    """The Returns sections are prose wrapped at the section's indentation: one table row."""
    checked = 0
    for page in _api_pages(site):
        for path, section in _sections(page.read_text(encoding="utf-8")).items():
            own = section.split('<div class="doc doc-children">', 1)[0]
            for table in re.findall(
                r'<span class="doc-section-title">Returns:</span></p>\s*<table>(.*?)</table>',
                own,
                flags=re.DOTALL,
            ):
                assert table.count('<tr class="doc-section-item">') == 1, path
                checked += 1
    assert checked >= 50, checked


def test_shared_input_defaults_in_the_docs_extension_match_the_library():
    """The extension's non-None defaults of the shared inputs are the library's."""
    import pmlfunc.losses._batch as batch

    sys.path.insert(0, str(HOOKS))
    try:
        import griffe_pmlfunc
    finally:
        sys.path.remove(str(HOOKS))
    source = inspect.getsource(batch.regularized)
    for key, default in griffe_pmlfunc.INPUT_DEFAULTS.items():
        assert key in batch.SHARED
        assert f'inputs.get("{key}", {default})' in source


def test_grouped_args_entries_are_split_one_per_name():
    sys.path.insert(0, str(HOOKS))
    try:
        import griffe_pmlfunc
    finally:
        sys.path.remove(str(HOOKS))
    doc = (
        "Summary.\n\nArgs:\n    x: the input.\n    ref_emb, ref_labels: a separate\n"
        "        reference set.\n    y: more.\n\nReturns:\n    a, b: not parameters.\n"
    )
    out = griffe_pmlfunc.rst_to_markdown(doc)
    assert "    ref_emb: a separate\n        reference set.\n" in out
    assert "    ref_labels: a separate\n        reference set.\n    y: more." in out
    assert "    a, b: not parameters." in out  # only Args sections are split


def test_the_shared_inputs_are_documented_once_and_linked_from_each_batch_loss(site):
    page = (site / "api" / "losses" / "index.html").read_text(encoding="utf-8")
    assert page.count('id="pmlfunc.losses.BatchInputs"') == 1
    links = page.count('href="#pmlfunc.losses.BatchInputs"')
    import pmlfunc.losses as losses
    from pmlfunc.losses._batch import spec_of

    batch_losses = [n for n in losses.__all__ if spec_of(getattr(losses, n))[0] is not None]
    assert len(batch_losses) >= 15
    assert links >= len(batch_losses)


# --- offline -----------------------------------------------------------------------------------


def test_the_site_loads_nothing_from_the_network(site):
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r'<(?:script|link|img)\b[^>]*(?:src|href)="(https?:)?//[^"]*"', text):
            pytest.fail(f"{page.relative_to(site)} loads {m.group(0)}")
    assert (site / "assets" / "pygments.css").read_text().count(".highlight") > 20


# --- the README --------------------------------------------------------------------------------


def test_readme_lists_exactly_the_chunkable_losses():
    """The README's list of chunkable losses is the registry's (the docs page generates its
    table from the same specs, ``docs/_hooks/generated_tables.py``)."""
    import pmlfunc as pf

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `pf.chunked`"))
    listed = row.split("`pf.chunked.chunkable()`:", 1)[1].split(";", 1)[0]
    names = tuple(re.findall(r"`(\w+)`", listed))
    assert names == pf.chunked.chunkable()
