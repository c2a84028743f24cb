"""Guided walkthroughs (ipywidgets), one module per problem family, and the diagnosis panel.

* :mod:`.base`: the widget (steps, checks, try-it) - see its docstring for what a step is;
* :mod:`.panel`: the panel shown below a failed cell's traceback;
* :mod:`.context`: the user's own config and error, which the steps lint, patch and read;
* :mod:`.diffs`, :mod:`.checks`: the diffs and the shared checks (doctor, lint, source scan);
* one module per family: :mod:`.oom`, :mod:`.router`, :mod:`.timeout`, :mod:`.install`,
  :mod:`.native_moe`, :mod:`.pitfalls`.

Advice is never written here: every step cites knowledge-base fixes by ``(entry id, fix id)``.
"""

from __future__ import annotations

from typing import Any, Callable

from troubleshooter.walkthroughs.base import Outcome, Step, TryResult, Walkthrough
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import config_diff, diff_html, merge_patch, text_diff
from troubleshooter.walkthroughs.install import install_walkthrough
from troubleshooter.walkthroughs.native_moe import native_moe_walkthrough
from troubleshooter.walkthroughs.oom import oom_walkthrough
from troubleshooter.walkthroughs.panel import DiagnosisPanel
from troubleshooter.walkthroughs.pitfalls import pitfalls_walkthrough
from troubleshooter.walkthroughs.router import router_walkthrough
from troubleshooter.walkthroughs.timeout import timeout_walkthrough

__all__ = ["BUILDERS", "DiagnosisPanel", "Outcome", "Step", "TryResult", "UserContext", "WALKTHROUGH_FOR",
           "Walkthrough", "config_diff", "diff_html", "merge_patch", "text_diff", "walkthrough", "walkthrough_title"]

BUILDERS: dict[str, Callable[..., Walkthrough]] = {
    "oom": oom_walkthrough,
    "router-collapse": router_walkthrough,
    "timeout": timeout_walkthrough,
    "install": install_walkthrough,
    "native-moe-zero3": native_moe_walkthrough,
    "zero3-pitfalls": pitfalls_walkthrough,
}

#: Knowledge-base family -> walkthrough. Families without one (config, host) get a panel only.
WALKTHROUGH_FOR = {**{f: f for f in BUILDERS}, "autoep": "native-moe-zero3"}

_TITLES = {"oom": "Out of memory (GPU)", "router-collapse": "Router collapse / load imbalance",
           "timeout": "Collective timeout", "install": "CUDA mismatch or install problem",
           "native-moe-zero3": "ZeRO-3 with native MoE", "zero3-pitfalls": "ZeRO-3 pitfalls"}


def walkthrough_title(family: str, entry_id: str = "") -> str | None:
    """The title a user reads on the button; None when the family has no walkthrough."""
    name = WALKTHROUGH_FOR.get(family)
    if name is None:
        return None
    return "Out of memory (host RAM)" if entry_id == "cpu-oom" else _TITLES[name]


def walkthrough(family: str, **context: Any) -> Walkthrough:
    """The walkthrough for a knowledge-base family (``oom``, ``router-collapse``, ...)."""
    try:
        builder = BUILDERS[WALKTHROUGH_FOR[family]]
    except KeyError:
        raise KeyError(f"no walkthrough for family {family!r}; there are: {', '.join(BUILDERS)}") from None
    return builder(**context)
