"""Deciding which knowledge-base entries a report's evidence names, and saying why.

Why not the first pattern that hits: a pattern written against one wording misses the others,
and a broad one ("any error raised inside script X") claims errors whose cause and fixes are
another's. So an entry is named on evidence, and the evidence is stated in its TOML file:

* its ``patterns`` (and ``contextual`` ones), tried on the report as pasted and on its
  normalised form (:mod:`troubleshooter.normalize`), so a mangled paste still matches;
* ``[evidence] requires``: terms that must also hold for a pattern hit to count;
* ``[evidence] excludes``: terms that rule the entry out, whatever matched;
* ``[[evidence.claims]]``: sets of terms that name the entry without any of its patterns (the
  shape of a message with a ZeRO-3 config beside it; a loss scale halving to its minimum);
* its ``symptoms``: an error line cut mid-message that is the start of one of them (and of no
  other entry's) names it;
* ``broad`` (on the table or on a claim): the entry is named on that evidence only when no more
  specific error entry is named; ``explain`` then also drops it when none of its fixes applies;
* ``explains``: entries whose errors this entry's cause also explains (Lightning's refusal of
  gradient_accumulation_steps, then DeepSpeed's batch assertion once the key is removed): when
  both are named in one report, this one goes first, whichever error came last.

A term is ``kind:regex``: a fact of that kind (:mod:`troubleshooter.evidence`) whose value the
regex finds, case-insensitively; ``text:regex`` searches the normalised report itself. Every
claim carries the facts it used (:attr:`Claimed.evidence`), which ``explain --why`` prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Iterable

from troubleshooter.evidence import Evidence, Fact
from troubleshooter.knowledge.matching import Match, line_at, match_entries, rank_key
from troubleshooter.normalize import WINDOW_CHARS, Normalized

if TYPE_CHECKING:  # pragma: no cover - typing only
    from lightning_zeromoe.knowledge import Entry

__all__ = ["Claimed", "decide", "holds"]


@dataclass(frozen=True)
class Claimed:
    """An entry the evidence names: its match (in the input's lines), the evidence, and whether
    it was named on broad evidence only."""

    match: Match
    evidence: tuple[str, ...]
    broad: bool = False


#: The normalised text is matched in its last this-many characters (the part normalize() changes):
#: a paste is short, and the input as it is was matched whole already.
NORMALISED_CHARS = WINDOW_CHARS
#: A cut error line names the entry whose symptom it starts only with this much message.
CUT_MIN = 25


@lru_cache(maxsize=None)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE | re.MULTILINE)


def holds(term: str, ev: Evidence, norm: Normalized) -> Fact | None:
    """The fact that makes ``term`` hold (the last one), or None."""
    kind, _, pattern = term.partition(":")
    if kind == "text":  # the report's last NORMALISED_CHARS, like the normalised matching
        start = max(0, len(norm.text) - NORMALISED_CHARS)
        last = None
        for last in _compiled(pattern).finditer(norm.text, start):
            pass
        if last is None:
            return None
        return Fact("text", last.group()[:160], norm.line_of_offset(last.start()), last.start())
    return ev.find(kind, _compiled(pattern))


def _in_input(m: Match, norm: Normalized, base: int) -> Match:
    """A match found in the normalised text (from ``base`` on), placed on the input's line and
    quoting it."""
    line_no = norm.line_of_offset(base + m.offset)
    offset = norm.input_offset(base + m.offset)
    return Match(m.entry, m.pattern, line_no, norm.quote(line_no)[:300], offset, m.count, m.details)


def _at_fact(entry: "Entry", why: str, facts: list[Fact], norm: Normalized) -> Match:
    """A match for a claim: on the line of its last located fact (else the input's last line)."""
    located = [f for f in facts if f.line_no]
    if located:
        line_no = max(located, key=lambda f: f.line_no).line_no
    else:
        line_no = norm.original.rstrip("\n").count("\n") + 1
    offset = norm.offset_of_line(line_no)
    _no, snippet = line_at(norm.original, offset)
    return Match(entry, f"claim: {why}", line_no, snippet, offset, 1, {})


def _claim(entry: "Entry", ev: Evidence, norm: Normalized) -> Claimed | None:
    for claim in entry.evidence.claims:
        facts: list[Fact | None] = []
        for term in claim.when:  # in order, stopping at the first that does not hold
            facts.append(holds(term, ev, norm))
            if facts[-1] is None:
                break
        if not all(facts):
            continue
        if any(holds(t, ev, norm) is not None for t in claim.unless):
            continue
        used = [f for f in facts if f is not None]
        return Claimed(_at_fact(entry, claim.why, used, norm),
                       (f"claim: {claim.why}", *(f"{t} <- {f.describe()}" for t, f in zip(claim.when, used))),
                       claim.broad)
    return None


def _squeezed(text: str) -> str:
    return " ".join(text.lower().split())


def _cut_inside(rest: str) -> bool:
    """Whether the rest of a symptom after a line is more of the message, not the symptom's own
    note on it (`` (in backward, under ZeRO-3)``, ``: almost every step``): a complete message that
    the entry names only with more context is not a cut one."""
    return bool(rest) and not rest.startswith((" (", ": ", " -", " —", "; ", " ...", "..."))


def _in_context(entry: "Entry", norm: Normalized) -> bool:
    """An entry whose messages are ambiguous alone (it has ``context`` patterns) is named by a cut
    line only when the report shows one of them (a ZeRO-3 config, a ZeRO-3 frame)."""
    return not entry.compiled_context or any(p.search(norm.text) for p in entry.compiled_context)


def _cut_symptoms(entries: tuple["Entry", ...], ev: Evidence, norm: Normalized) -> dict[str, Claimed]:
    """Entries named by an error line cut mid-message: the line (at least CUT_MIN characters of
    message) is the start of one of the entry's symptoms, and of no other entry's, cut inside the
    message (see _cut_inside), with the entry's context when it has one (see _in_context)."""
    found: dict[str, Claimed] = {}
    for error in ev.of("error"):
        message = error.value.split(": ", 1)[1] if ": " in error.value else ""
        if len(message) < CUT_MIN:
            continue
        line = _squeezed(error.value)
        hits = {e.id: (e, symptom) for e in entries for symptom in e.symptoms
                if _squeezed(symptom).startswith(line) and _cut_inside(_squeezed(symptom)[len(line):])
                and _in_context(e, norm)}
        if len(hits) != 1:
            continue
        (entry, symptom), = hits.values()
        why = "the error line is the start of a symptom the entry lists, cut in the paste"
        found[entry.id] = Claimed(_at_fact(entry, why, [error], norm),
                                  (f"claim: {why}", f"symptom: {symptom[:160]}", f"<- {error.describe()}"))
    return found


def decide(text: str, norm: Normalized, ev: Evidence, entries: Iterable["Entry"]) -> list[Claimed]:
    """The entries the report's evidence names, best first (``matching.rank_key``)."""
    entries = tuple(entries)
    found = {m.entry.id: (m, False) for m in match_entries(text, entries)}
    if norm.changed:
        start = len(norm.text) - NORMALISED_CHARS
        base = 0 if start <= 0 else norm.text.find("\n", start) + 1
        for m in match_entries(norm.text[base:], entries):
            if m.entry.id not in found:
                found[m.entry.id] = (_in_input(m, norm, base), True)
    cut = _cut_symptoms(entries, ev, norm)
    claimed: list[Claimed] = []
    for entry in entries:
        rules = entry.evidence
        result: Claimed | None = None
        if entry.id in found:
            m, normalised = found[entry.id]
            needed = [(t, holds(t, ev, norm)) for t in rules.requires]
            if all(f is not None for _, f in needed):
                how = " in the normalised paste" if normalised else ""
                pattern = m.pattern if len(m.pattern) <= 100 else m.pattern[:99] + "…"
                result = Claimed(m, (f"pattern{how}: {pattern} (line {m.line_no}, {m.count} hit"
                                     f"{'s' if m.count != 1 else ''})",
                                     *(f"requires {t} <- {f.describe()}" for t, f in needed if f)), rules.broad)
        if result is None:
            result = _claim(entry, ev, norm) or cut.get(entry.id)
        if result is None:
            continue
        if any(holds(t, ev, norm) is not None for t in rules.excludes):
            continue
        claimed.append(result)
    if any(not c.broad and c.match.entry.severity == "error" for c in claimed):
        claimed = [c for c in claimed if not c.broad]
    return _causes_first(sorted(claimed, key=lambda c: rank_key(c.match)))


def _causes_first(claimed: list[Claimed]) -> list[Claimed]:
    """Each entry whose ``explains`` names another named entry is moved before it."""
    out = list(claimed)
    for cause in claimed:
        named = [i for i, c in enumerate(out) if c.match.entry.id in cause.match.entry.evidence.explains]
        at = out.index(cause)
        if named and min(named) < at:
            out.insert(min(named), out.pop(at))
    return out
