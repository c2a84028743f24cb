"""The look of everything the troubleshooter shows in a notebook: one stylesheet, scoped to our output.

Why our own CSS: JupyterLab right-aligns table cells in rendered HTML (``.jp-RenderedHTMLCommon
td { text-align: right }``), and a ``<pre>`` diff inside such a cell inherits it, which destroys
the JSON indentation; ipywidgets' HTML widget sets a 28 px line height (one widget row) that
double-spaces wrapped text. Every rule here is under the ``tsh`` class (a ``div.tsh`` wrapper, or
``add_class("tsh")`` on a widget), so nothing outside our output changes. JupyterLab's cell rule
is ``:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td`` (two classes and an element); ours
name the class twice (``div.tsh.tsh table td``: two classes, three elements), so they win
without ``!important``. ``tests/test_browser.py`` checks the computed styles in JupyterLab.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

__all__ = ["CSS", "figure_png", "img_tag", "scoped"]

CSS = """<style>
div.tsh, div.tsh div, div.tsh p, div.tsh li { text-align: left; line-height: 1.45; }
div.tsh .widget-html-content, div.tsh .jupyter-widget-html-content { line-height: 1.45; }
div.tsh.tsh table { border-collapse: collapse; margin: 4px 0; width: auto; }
div.tsh.tsh table th, div.tsh.tsh table td, div.tsh.tsh table tr { text-align: left; vertical-align: top; padding: 3px 10px;
  line-height: 1.45; white-space: normal; border-bottom: 1px solid #e0e0e0; }
div.tsh.tsh table th { font-weight: 600; background: #f3f3f3; border-bottom: 2px solid #bdbdbd; }
div.tsh pre.tsh-diff { text-align: left; white-space: pre; font-family: var(--jp-code-font-family, monospace);
  font-size: 12px; line-height: 1.35; background: #f7f7f7; padding: 4px 8px; margin: 4px 0; overflow-x: auto; }
div.tsh details > summary { cursor: pointer; }
div.tsh .tsh-muted { color: #555; }
div.tsh .tsh-example { background: #fff8e1; border-left: 3px solid #f9a825; padding: 2px 8px; margin: 4px 0; }
div.tsh .tsh-yours { background: #e8f5e9; border-left: 3px solid #2e7d32; padding: 2px 8px; margin: 4px 0; }
div.tsh img.tsh-figure { max-width: 100%; display: block; margin: 4px 0; }
</style>"""


def scoped(body: str, kind: str = "") -> str:
    """``body`` inside our scope, with the stylesheet (a notebook output is shown on its own)."""
    extra = f" tsh-{kind}" if kind else ""
    return f"<div class='tsh{extra}'>{CSS}{body}</div>"


def figure_png(fig: Any, dpi: int = 100) -> bytes:
    """A matplotlib figure as PNG bytes (no pyplot, no display hook needed)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def img_tag(fig: Any, alt: str) -> str:
    """An ``<img>`` with the figure inline as a data URL, for HTML that a widget shows."""
    data = base64.b64encode(figure_png(fig)).decode("ascii")
    return f"<img class='tsh-figure' alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"
