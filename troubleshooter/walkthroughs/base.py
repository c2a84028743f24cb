"""The walkthrough widget: steps, what a check found, and a try-it's numbers before and after.

A walkthrough is a list of :class:`Step`. Each step

* shows the knowledge base's own fix texts, cited by ``(entry id, fix id)``: advice is written
  once, in ``lightning_zeromoe/knowledge/entries``, and every face of the troubleshooter shows it;
* runs a check for the user: a real call (doctor checks, lint, the memory planner, the numbers
  of the user's own error), never canned text;
* proposes the fix as a unified diff of the user's config when the notebook holds one (see
  :mod:`.context`), of a clearly labelled example otherwise;
* and, where a tiny reproduction exists, has a "Try it" button that reruns it with the fix and
  shows the numbers before and after (and a picture when there is one).

Everything is driven through methods (``next()``, ``back()``, ``run_check()``, ``try_it()``) that
the buttons call, so tests and notebooks can drive a walkthrough with ``button.click()`` and read
its state (``index``, ``outcomes``, ``tries``) as well as the HTML it shows.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import ipywidgets as W

from troubleshooter import knowledge
from troubleshooter.notebook_css import CSS, img_tag
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import diff_html

__all__ = ["Outcome", "Step", "TryResult", "Walkthrough", "cause_html", "esc", "fmt"]


def esc(text: Any) -> str:
    return html.escape(str(text))


def fmt(value: Any) -> str:
    """A number as people read it: one decimal when it has no more (MiB, seconds), else 3 decimals
    below 100 and one above (never 4.860217332839966)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == round(value, 1) or abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.3f}"
    return str(value)


def cause_html(cause: str) -> str:
    """A cause paragraph: its first sentence, and the rest behind a click (never cut mid-sentence)."""
    text = " ".join(cause.split())
    end = text.find(". ")
    if end == -1 or end > 240:
        return f"<div class='tsh-muted'>{esc(text)}</div>"
    return (f"<details class='tsh-cause'><summary>{esc(text[:end + 1])} <i>(more)</i></summary>"
            f"<div class='tsh-muted'>{esc(text[end + 2:])}</div></details>")


@dataclass
class Outcome:
    """What a check found: a headline, whether it looks fine, the numbers, and detail lines."""

    headline: str
    ok: bool | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)

    def html(self) -> str:
        icon = {True: "✔", False: "✖", None: "ℹ"}[self.ok]
        rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(fmt(v))}</td></tr>" for k, v in self.numbers.items())
        details = "".join(f"<li>{esc(d)}</li>" for d in self.details)
        return (f"<div class='troubleshooter-outcome'><b>{icon} {esc(self.headline)}</b>"
                + (f"<table><thead><tr><th>measured</th><th>value</th></tr></thead><tbody>{rows}</tbody></table>"
                   if rows else "") + (f"<ul>{details}</ul>" if details else "") + "</div>")


@dataclass
class TryResult:
    """Numbers from the reproduction without the fix (``before``) and with it (``after``)."""

    before: dict[str, Any]
    after: dict[str, Any]
    note: str = ""
    figure: Any = None

    def html(self) -> str:
        keys = list(dict.fromkeys([*self.before, *self.after]))
        rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(fmt(self.before.get(k, '-')))}</td>"
                       f"<td>{esc(fmt(self.after.get(k, '-')))}</td></tr>" for k in keys)
        picture = img_tag(self.figure, "before and after the fix") if self.figure is not None else ""
        return ("<div class='troubleshooter-try'><table><thead><tr><th>measured</th><th>before</th>"
                f"<th>after the fix</th></tr></thead><tbody>{rows}</tbody></table>"
                + (f"<div>{esc(self.note)}</div>" if self.note else "") + picture + "</div>")


@dataclass(frozen=True)
class Step:
    """One step of a walkthrough (see the module docstring).

    ``fixes`` are fix ids of ``entry``; ``values`` fill their ``{placeholders}``.
    """

    title: str
    entry: str
    fixes: tuple[str, ...]
    check_label: str
    check: Callable[[], Outcome]
    patch: Callable[[], str]  # the unified diff of the proposed fix
    try_it: Callable[[], TryResult] | None = None
    try_unavailable: str = ""  # why there is no try-it, shown instead of the button
    values: Mapping[str, Any] = field(default_factory=dict)

    def advice(self) -> list[str]:
        """The cited fix texts, from the knowledge base."""
        return [knowledge.fix(self.entry, f).render(**self.values) for f in self.fixes]


def _button(description: str, icon: str, **kwargs: Any) -> W.Button:
    # width auto: the default 148 px cuts labels ("Lint the AutoE...")
    return W.Button(description=description, icon=icon, layout=W.Layout(width="auto"), **kwargs)


class Walkthrough(W.VBox):
    """A step-by-step guide. State: ``index``, ``outcomes`` (check results), ``tries``, ``errors``."""

    def __init__(self, family: str, title: str, entries: tuple[str, ...], steps: list[Step],
                 context: UserContext | None = None, example_note: str = "") -> None:
        self.family, self.title, self.entries, self.steps = family, title, entries, steps
        self.context = context or UserContext()
        self.index = 0
        self.outcomes: dict[int, Outcome] = {}
        self.tries: dict[int, TryResult] = {}
        self.errors: dict[int, str] = {}
        self.header = W.HTML()
        self.position = W.HTML()
        self.what = W.HTML()
        self.check_button = _button("Run the check", "search")
        self.check_output = W.HTML()
        self.patch_view = W.HTML()
        self.try_button = _button("Try it", "play", button_style="success")
        self.try_output = W.HTML()
        self.back_button = _button("Back", "arrow-left")
        self.next_button = _button("Next", "arrow-right")
        self.check_button.on_click(lambda _b: self.run_check())
        self.try_button.on_click(lambda _b: self.try_it())
        self.back_button.on_click(lambda _b: self.back())
        self.next_button.on_click(lambda _b: self.next())
        shown = self.context.entry_id if self.context.entry_id in entries else entries[0]
        if example_note:
            source = f"<div class='tsh-example'>{esc(example_note)}</div>"
        elif self.context.has_config:
            source = (f"<div class='tsh-yours'>Your config: <code>{esc(self.context.config_label)}</code> "
                      "(the steps lint and patch it)</div>")
        else:
            source = ""
        self.header.value = (f"{CSS}<h3 style='margin:4px 0'>Walkthrough: {esc(title)}</h3>"
                             + cause_html(knowledge.get(shown).cause) + source)
        super().__init__([self.header, self.position, self.what,
                          W.HBox([self.check_button]), self.check_output, self.patch_view,
                          W.HBox([self.try_button]), self.try_output,
                          W.HBox([self.back_button, self.next_button])])
        self.add_class("tsh")
        self.add_class("troubleshooter-walkthrough")
        self.go(0)

    @property
    def step(self) -> Step:
        return self.steps[self.index]

    def go(self, index: int) -> None:
        """Show step ``index`` (with whatever its check and try-it already produced)."""
        self.index = max(0, min(index, len(self.steps) - 1))
        step = self.step
        self.position.value = f"<b>Step {self.index + 1} of {len(self.steps)}: {esc(step.title)}</b>"
        advice = "".join(f"<li>{esc(a)}</li>" for a in step.advice())
        self.what.value = (f"<div><b>What to do</b> <span class='tsh-muted'>(knowledge base: "
                           f"{esc(knowledge.get(step.entry).title)})</span><ol>{advice}</ol></div>")
        self.check_button.description = step.check_label
        self.check_output.value = self._check_html()
        try:
            diff = step.patch()
        except Exception as err:  # noqa: BLE001 - a broken patch must not break navigation
            diff = f"(could not build the patch: {type(err).__name__}: {err})"
        self.patch_view.value = "<b>Proposed fix</b>" + diff_html(diff)
        self.try_button.disabled = step.try_it is None
        self.try_button.tooltip = step.try_unavailable or "Rerun the tiny reproduction with this fix"
        self.try_output.value = (self.tries[self.index].html() if self.index in self.tries else
                                 f"<i>{esc(step.try_unavailable)}</i>" if step.try_it is None else "")
        self.back_button.disabled = self.index == 0
        self.next_button.disabled = self.index == len(self.steps) - 1

    def _check_html(self) -> str:
        if self.index in self.errors:
            return f"<div style='color:#c62828'>{esc(self.errors[self.index])}</div>"
        if self.index in self.outcomes:
            return self.outcomes[self.index].html()
        return ""

    def next(self) -> None:
        self.go(self.index + 1)

    def back(self) -> None:
        self.go(self.index - 1)

    def run_check(self) -> Outcome | None:
        """Run the current step's check; its outcome is stored and shown (errors too, not raised)."""
        i = self.index
        self.check_output.value = "<i>running…</i>"
        try:
            self.outcomes[i] = self.steps[i].check()
            self.errors.pop(i, None)
        except Exception as err:  # noqa: BLE001 - a button callback must not raise into the frontend
            self.errors[i] = f"the check failed: {type(err).__name__}: {err}"
        if self.index == i:
            self.check_output.value = self._check_html()
        return self.outcomes.get(i)

    def try_it(self) -> TryResult | None:
        """Rerun the reproduction with this step's fix; show before/after numbers."""
        i = self.index
        step = self.steps[i]
        if step.try_it is None:
            return None
        self.try_output.value = "<i>running the reproduction…</i>"
        try:
            self.tries[i] = step.try_it()
            self.errors.pop(i, None)
            self.try_output.value = self.tries[i].html()
        except Exception as err:  # noqa: BLE001
            self.errors[i] = f"the reproduction failed: {type(err).__name__}: {err}"
            self.try_output.value = f"<div style='color:#c62828'>{esc(self.errors[i])}</div>"
        return self.tries.get(i)

    def __repr__(self) -> str:
        return f"<Walkthrough {self.title!r}: step {self.index + 1}/{len(self.steps)} {self.step.title!r}>"
