"""Proposed fixes as unified diffs: of a text, of a config under a JSON merge patch, and as HTML."""

from __future__ import annotations

import difflib
import html
import json
from typing import Mapping

from troubleshooter.lint import merge_patch

__all__ = ["config_diff", "diff_html", "merge_patch", "text_diff"]


def text_diff(before: str, after: str, name: str = "train.py") -> str:
    """A unified diff of two texts, as ``git diff`` would show it."""
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 fromfile=f"a/{name}", tofile=f"b/{name}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def config_diff(config: Mapping, patch: Mapping, name: str = "ds_config.json") -> str:
    """The diff a JSON merge patch makes to a config, both pretty-printed."""
    before = json.dumps(config, indent=2, default=str) + "\n"
    after = json.dumps(merge_patch(config, patch), indent=2, default=str) + "\n"
    return text_diff(before, after, name)


def diff_html(diff: str) -> str:
    """A diff as coloured, left-aligned HTML (added lines green, removed red); style: notebook_css."""
    out = []
    for line in diff.splitlines():
        colour = ("#1b5e20" if line.startswith("+") and not line.startswith("+++") else
                  "#b71c1c" if line.startswith("-") and not line.startswith("---") else
                  "#6a1b9a" if line.startswith("@@") else "#333")
        out.append(f"<span style='color:{colour}'>{html.escape(line)}</span>")
    return "<pre class='tsh-diff troubleshooter-diff'>" + "\n".join(out) + "</pre>"
