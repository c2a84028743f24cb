"""The diagnosis panel: what the knowledge base knows about an error, and its walkthrough's button.

Shown after a failed cell (short) and by ``%%troubleshoot`` (full), always below the traceback.
It names things in words (the entry's title, the walkthrough's title), not slugs; the line that
matched is not repeated (it is the last line of the traceback just above); for a CUDA OOM it shows
what the numbers in the message say (fragmentation or not).
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import ipywidgets as W

from troubleshooter import knowledge
from troubleshooter.notebook_css import CSS
from troubleshooter.walkthroughs.base import Walkthrough, cause_html, esc
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import diff_html

__all__ = ["DiagnosisPanel"]


class DiagnosisPanel(W.VBox):
    """What the knowledge base knows about an error, and a button that opens the walkthrough.

    ``full=False`` is the short panel appended after any failed cell: the problem, the numbers
    of the message and the first fix. ``full=True`` (``%%troubleshoot``) adds every fix step and
    the entry's patch. ``context``: the user's config and error text, handed to the walkthrough.
    """

    def __init__(self, diagnoses: list, *, full: bool = False, context: UserContext | None = None) -> None:
        from troubleshooter.walkthroughs import walkthrough_title

        self.diagnoses = diagnoses
        self.diagnosis = diagnoses[0]
        self.full = full
        self.context = context or UserContext(entry_id=self.diagnosis.entry_id)
        self.walkthrough: Walkthrough | None = None
        self.walkthrough_title = walkthrough_title(self.diagnosis.family, self.diagnosis.entry_id)
        self.summary = W.HTML(self._html())
        self.button = W.Button(description=f"Open the walkthrough: {self.walkthrough_title}"
                               if self.walkthrough_title else "No walkthrough for this problem",
                               icon="life-ring", disabled=self.walkthrough_title is None,
                               layout=W.Layout(width="auto", align_self="flex-start"))
        self.button.on_click(lambda _b: self.open_walkthrough())
        super().__init__([self.summary, self.button])
        self.add_class("tsh")
        self.add_class("troubleshooter-panel")

    def _numbers(self) -> str:
        n = self.context.oom if self.diagnosis.entry_id == "cuda-oom" else None
        return n.summary() if n is not None else ""

    def _html(self) -> str:
        d = self.diagnosis
        colour = {"error": "#c62828", "warning": "#b26a00"}.get(d.severity, "#1565c0")
        parts = [f"{CSS}<div class='troubleshooter-diagnosis' style='border-left:4px solid {colour};"
                 f"padding-left:8px'><b>troubleshooter: {esc(d.title)}</b>", cause_html(d.cause)]
        numbers = self._numbers()
        if numbers:
            parts.append(f"<div><b>The numbers in the message</b>: {esc(numbers)}</div>")
        if self.full:
            parts.append("<b>What to do</b><ol>" + "".join(f"<li>{esc(f)}</li>" for f in d.fix) + "</ol>")
            if d.patch:
                parts.append(diff_html(d.patch) if d.patch_kind == "diff" else
                             "<b>Config patch</b>" + diff_html(json.dumps(json.loads(d.patch), indent=2)))
        else:
            parts.append(f"<div><b>First thing to do</b>: {esc(d.fix[0])}</div>")
        others = [knowledge.get(o.entry_id).title for o in self.diagnoses[1:4]]
        if others:
            parts.append(f"<div class='tsh-muted'>Also matched: {esc('; '.join(others))}</div>")
        return "".join(parts) + "</div>"

    def open_walkthrough(self) -> Walkthrough | None:
        """Build the walkthrough for this family and show it under the panel (once)."""
        from troubleshooter.walkthroughs import walkthrough

        if self.walkthrough_title is None:
            return None
        if self.walkthrough is None:
            self.walkthrough = walkthrough(self.diagnosis.family, context=self.context)
            self.children = (*self.children, self.walkthrough)
            self.button.disabled = True
        return self.walkthrough

    def plain(self) -> str:
        d = self.diagnosis
        text = f"troubleshooter: {d.title} [{d.entry_id}]\n"
        numbers = self._numbers()
        if numbers:
            text += f"  the numbers in the message: {numbers}\n"
        if self.full:
            text += textwrap.indent(d.cause.strip(), "  ") + "\n" + "".join(
                f"  {i}. {f}\n" for i, f in enumerate(d.fix, 1))
        else:
            text += f"  first thing to do: {d.fix[0]}\n"
        return text + (f"  walkthrough: {self.walkthrough_title}" if self.walkthrough_title else
                       "  (no walkthrough for this problem)")

    def __repr__(self) -> str:
        return self.plain()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """The widget view, plus the whole plain text (ipywidgets cuts ``text/plain`` at 110 chars)."""
        data = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = self.plain()
        return data
