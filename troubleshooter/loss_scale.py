"""The fp16 loss-scale history a log shows: overflows counted against steps.

Why count: every fp16 run starts by skipping a few steps while the dynamic loss scale searches
down from its initial value (DeepSpeed: 2^16, halved on each overflow), and a long run skips one
now and then when the scale grows back after ``scale_window`` good steps. Neither is a problem.
A collapse is: the scale falling to its minimum (DeepSpeed's ``min_scale``, 1 by default), or
skipped steps that do not stop (DeepSpeed's ``step=N, skipped=K`` with K growing as N does).
:func:`history` reads what the log says; :func:`collapse` says whether it is a collapse, and why.

Wordings read (deepspeed 0.19.8 ``runtime/fp16/loss_scaler.py`` and ``runtime/engine.py``, and
older releases and other trainers' forms of the same events): ``OVERFLOW! Rank 0 Skipping step.
Attempted loss scale: 65536, reducing to 32768``, ``fp16 dynamic loss scale overflow! Skipping
step. Attempted loss scale: ...``, ``Gradient overflow.  Skipping step, ... reducing loss scale
to 32768.0``, ``overflow detected, setting loss scale to: 64.0``, ``Grad overflow on iteration 12``,
``step=100, skipped=7``, ``Current loss scale already at minimum``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["LossScaleHistory", "collapse", "history"]

_OVERFLOW = re.compile(
    r"OVERFLOW! (?:Rank \d+ )?Skipping step|loss scale overflow!? Skipping step"
    r"|Grad(?:ient)? overflow[.,:]? +(?:Skipping step|on iteration)"
    r"|overflow detected, (?:setting|reducing) (?:the )?(?:loss )?scale", re.IGNORECASE)
_NUMBER = r"(\d+(?:\.\d+)?(?:e[-+]?\d+)?)"
_ATTEMPTED = re.compile(r"Attempted loss scale:? " + _NUMBER, re.IGNORECASE)
_REDUCED = re.compile(r"(?:reducing (?:loss scale )?to|setting (?:the )?(?:loss )?scale to:?)\s*" + _NUMBER,
                      re.IGNORECASE)
#: DeepSpeed's "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
#: (runtime/fp16/loss_scaler.py), also quoted without its first word in a sentence about it.
_AT_MINIMUM = re.compile(r"loss scale already at minimum|Minimum loss scale reached", re.IGNORECASE)
_COUNTER = re.compile(r"\bstep[=:]\s*(\d+),\s*skipped[=:]\s*(\d+)", re.IGNORECASE)
_MIN_SCALE = re.compile(r"""['"]?min(?:_loss)?_scale['"]?\s*[:=]\s*""" + _NUMBER, re.IGNORECASE)
_INIT_SCALE = re.compile(r"""['"]?(?:init(?:ial)?_scale|initial_dynamic_scale)['"]?\s*(?:[:=]|\.{2,})?\s*"""
                         + _NUMBER, re.IGNORECASE)
_INIT_POWER = re.compile(r"""initial_scale_power['"]?\s*(?:[:=]|\.{2,})?\s*(\d+)\b""", re.IGNORECASE)
#: Step counters of other forms: tqdm bars ("| 120/1000 ["), "global_step=120", "iteration 120".
_STEPS = re.compile(r"\|\s*(\d+)/\d+ \[|\b(?:global_step|iteration|iter)\s*[=:]?\s*(\d+)\b", re.IGNORECASE)

#: DeepSpeed's defaults (runtime/fp16/loss_scaler.py, 0.19.8): init 2^16, min_scale 1.
DEFAULT_INITIAL = 2.0 ** 16
DEFAULT_MINIMUM = 1.0
#: Past this many steps, skipping at least half of them is a collapse, not the start-up search.
MIN_STEPS = 20
#: Over the last this-many steps between two step counters, all skipped means they do not stop.
RECENT_STEPS = 10
#: After the start-up search, this many overflows in a row with a falling scale do not stop.
FALLING_RUN = 6
#: A log that starts mid-run (a pasted excerpt): a first overflow at a scale this many halvings
#: below the initial one, past MIN_STEPS steps, is not the start-up search.
LATE_HALVINGS = 8
#: A late run of at least this many halvings that ends within this factor of the minimum is a
#: collapse under way (two more halvings and every step overflows).
NEAR_RUN = 3
NEAR_MINIMUM = 4.0


@dataclass(frozen=True)
class LossScaleHistory:
    """What a log says about fp16 loss scaling."""

    overflows: int  # overflow (skipped-step) lines
    lowest: float | None  # the lowest scale it was reduced to
    initial: float  # the first attempted scale (or the configured / default initial scale)
    minimum: float  # the configured minimum (DeepSpeed's min_scale), else the default
    at_minimum: bool  # an explicit "already at minimum" / "Minimum loss scale reached"
    counters: tuple[tuple[int, int], ...]  # DeepSpeed's (step, skipped), in order
    steps: int | None  # the highest step another counter shows, when there is one
    #: overflows of the start-up search (the first run of halvings), None when the lines carry
    #: no scales to tell
    search: int | None = None
    #: the longest later run of overflows in which the scale only falls (it never grew back)
    falling: int = 0


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _runs(scales: list[tuple[float | None, float | None]]) -> tuple[int | None, int]:
    """The start-up search's length, and the longest later run of falling scales."""
    if not scales or scales[0][0] is None:
        return None, 0
    runs: list[int] = []
    last: float | None = None
    for attempted, reduced in scales:
        if attempted is None:
            return (runs[0] if runs else None), max(runs[1:], default=0)
        if last is None or attempted > last:  # the first overflow, or the scale grew back
            runs.append(0)
        runs[-1] += 1
        last = reduced if reduced is not None else attempted
    return runs[0], max(runs[1:], default=0)


def history(text: str) -> LossScaleHistory:
    """Read the loss-scale events out of a log."""
    overflows = 0
    scales: list[tuple[float | None, float | None]] = []
    end = -1
    for hit in _OVERFLOW.finditer(text):
        if hit.start() <= end:  # one line, one overflow
            continue
        end = text.find("\n", hit.end())
        end = len(text) if end == -1 else end
        line = text[text.rfind("\n", 0, hit.start()) + 1:end]
        overflows += 1
        attempted = _ATTEMPTED.search(line)
        reduced = _REDUCED.search(line)
        scales.append((_float(attempted.group(1)) if attempted else None,
                       _float(reduced.group(1)) if reduced else None))
    known = [v for pair in scales for v in pair if v is not None]
    configured_min = [v for m in _MIN_SCALE.finditer(text) if (v := _float(m.group(1))) is not None]
    configured_init = [v for m in _INIT_SCALE.finditer(text) if (v := _float(m.group(1))) is not None]
    configured_init += [2.0 ** int(m.group(1)) for m in _INIT_POWER.finditer(text) if int(m.group(1)) < 64]
    counters = tuple((int(m.group(1)), int(m.group(2))) for m in _COUNTER.finditer(text))
    other_steps = [int(a or b) for a, b in _STEPS.findall(text)]
    first = scales[0][0] if scales and scales[0][0] is not None else None
    steps = max(other_steps) if other_steps else None
    search, falling = _runs(scales)
    init = configured_init[0] if configured_init else DEFAULT_INITIAL
    if first is not None and steps is not None and steps >= MIN_STEPS and first * 2 ** LATE_HALVINGS <= init:
        # an excerpt from late in a run: its first run of halvings is no start-up search
        search, falling = 0, max(falling, search or 0)
    initial = first if first is not None else init
    return LossScaleHistory(
        overflows=overflows, lowest=min(known) if known else None, initial=max(initial, 1.0),
        minimum=configured_min[-1] if configured_min else DEFAULT_MINIMUM,
        at_minimum=bool(_AT_MINIMUM.search(text)), counters=counters,
        steps=steps, search=search, falling=falling)


def _fmt(value: float) -> str:
    return f"{value:g}"


def collapse(h: LossScaleHistory) -> str | None:
    """Why this history is a collapse (one sentence), or None when it is routine.

    The start-up search is discounted: its overflows when the lines show it (the first run of
    halvings), else as many as halving from the initial scale can make (log2(initial) + 2).
    """
    if h.at_minimum:
        return "the loss scale reached its minimum and could not go lower: every step overflows."
    if h.lowest is not None and h.lowest <= h.minimum:
        return (f"the loss scale fell to {_fmt(h.lowest)}, its minimum (min_scale {_fmt(h.minimum)}), "
                f"after {h.overflows} overflow{'s' if h.overflows != 1 else ''}: the gradients overflow "
                "whatever the scale.")
    search = h.search if h.search is not None else int(math.log2(h.initial)) + 2
    if h.search == 0 and h.falling >= NEAR_RUN and h.lowest is not None and h.lowest <= NEAR_MINIMUM * h.minimum:
        return (f"late in the run the scale halved {h.falling} times in a row, down to {_fmt(h.lowest)}, "
                f"within {_fmt(NEAR_MINIMUM)}x of its minimum ({_fmt(h.minimum)}): the overflows do not stop.")
    if h.counters:
        step, skipped = h.counters[-1]
        if step - search >= MIN_STEPS and 2 * (skipped - search) >= step - search:
            return (f"{skipped} of {step} steps were skipped for overflow (DeepSpeed's step/skipped "
                    "counter): far more than the start-up search of the loss scale.")
        if len(h.counters) >= 2:
            (s1, k1), (s2, k2) = h.counters[-2], h.counters[-1]
            if s1 >= max(MIN_STEPS, search) and s2 - s1 >= RECENT_STEPS and k2 - k1 >= 0.9 * (s2 - s1):
                return (f"{k2 - k1} of the last {s2 - s1} steps (steps {s1}-{s2}) were skipped for "
                        "overflow: the skipped steps do not stop.")
        return None
    if h.steps is not None:
        later = h.overflows - search
        if h.steps - search >= MIN_STEPS and 2 * later >= h.steps - search:
            return (f"{h.overflows} overflow (skipped-step) lines over {h.steps} steps: far more than "
                    "the start-up search of the loss scale.")
        return None
    if h.falling >= FALLING_RUN:
        return (f"after the start-up search the scale fell again {h.falling} times in a row without "
                "growing back: the skipped steps do not stop.")
    if h.search is None and h.overflows > search + 2:
        return (f"{h.overflows} overflow (skipped-step) lines, more than the start-up search from a "
                f"scale of {_fmt(h.initial)} makes: the skipped steps do not stop.")
    return None
