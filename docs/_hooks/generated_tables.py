"""mkdocs hook: tables generated from the library, so that the pages cannot drift from it.

A line ``<!-- generate: chunkable -->`` in a page becomes the table of what
:func:`pmlfunc.chunked.value_and_grad` can split over anchors, read from the losses' specs.
"""

from __future__ import annotations

import re

_MARKER = re.compile(r"^<!--\s*generate:\s*(\S+)\s*-->\s*$", re.MULTILINE)


def chunkable_table() -> str:
    import pmlfunc.losses as losses
    from pmlfunc.losses._batch import spec_of

    rows = ["| loss | splits over anchors | why not |", "|---|---|---|"]
    for name in losses.__all__:
        spec, _ = spec_of(getattr(losses, name))
        if spec is None:
            continue
        if spec.unchunkable is not None:
            rows.append(f"| `{name}` | no | {spec.unchunkable} |")
        elif spec.unchunkable_with:
            unless = ", ".join(f"`{k}`" for k in spec.unchunkable_with)
            why = "; ".join(f"`{k}`: {v}" for k, v in spec.unchunkable_with.items())
            rows.append(f"| `{name}` | yes, unless {unless} is set | {why} |")
        else:
            rows.append(f"| `{name}` | yes | |")
    return "\n".join(rows)


_TABLES = {"chunkable": chunkable_table}


def on_page_markdown(markdown, page, config, files):
    return _MARKER.sub(lambda m: _TABLES[m.group(1)](), markdown)
