"""Explain a traceback or log: match it against the knowledge base and say what to do.

The input (a file, standard input or the message itself) is read by
:mod:`troubleshooter.log_input`. Two diagnoses are refined with what the log itself says:

* a CUDA OOM: the sizes in the message (:mod:`troubleshooter.oom_numbers`) decide whether the
  fragmentation fix comes first or is left out;
* a rank that failed because another one did (a collective timeout, gloo's "Connection reset by
  peer", NCCL's "remote process exited", torchrun's ``ChildFailedError``): when the log also holds
  a rank's own error, that error is the diagnosis and the echo says it only followed; when it
  does not, the echo says where the first rank's error went (a C++ abort without a Python
  traceback counts: ``terminate called after throwing ...``).

Some entries' patterns only find candidates, and the log decides (``JUDGES``): fp16 overflow lines
are counted against the steps (:mod:`troubleshooter.loss_scale`; the start-up search of the loss
scale is not a problem), an expert-load or top-k printout must show a collapsed router
(:mod:`troubleshooter.expert_load`). And a fix is not proposed when the log shows it was already
followed (the variable it sets is set to that value: :mod:`troubleshooter.log_facts`), or when
the entry says it cannot help with what the log shows (a fix's ``skip_when``); the diagnosis
then says so.

Before any of that, the report is normalised (:mod:`troubleshooter.normalize`: prefixes,
Markdown, mangled identifiers, interleaved ranks, wrapped lines, errors quoted in prose), read into
typed facts (:mod:`troubleshooter.evidence`), and the entries are named on that evidence
(:mod:`troubleshooter.decide`): each diagnosis carries the evidence it was named on
(``Diagnosis.evidence``, printed by ``explain --why``). When nothing fits, :func:`recognised`
says what the report showed instead.

Exit codes of ``explain`` (see ``troubleshooter.cli``): 0 when at least one diagnosis was printed,
1 when nothing in the input matched a known problem, 2 when the input could not be read (missing,
empty or binary).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import lru_cache

from troubleshooter import evidence, expert_load, knowledge, log_facts, loss_scale
from troubleshooter.decide import Claimed, decide, holds
from troubleshooter.knowledge.matching import is_own, line_at
from troubleshooter.log_input import (
    MAX_BYTES,
    ExplainInputError,
    Input,
    clean,
    from_text,
    read_input,
    read_source,
)
from troubleshooter.normalize import Normalized, identifier_vocabulary, normalize
from troubleshooter.oom_numbers import format_bytes, parse_oom
from troubleshooter.typos import word_vocabulary

__all__ = ["MAX_BYTES", "Diagnosis", "ExplainInputError", "Input", "Recognised", "clean", "explain_input",
           "explain_text", "read_input", "read_source", "recognised"]

#: The entry family whose errors are usually the echo of another rank's failure.
ECHO_FAMILY = "timeout"
OOM_ENTRY = "cuda-oom"
PEER_ENTRY = "peer-rank-died"
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
#: cuda-oom's fixes in the order the OOM numbers call for (ids of the entry's [[fixes]]).
OOM_FRAGMENTED = ("expandable-segments", "lower-micro-batch", "activation-checkpointing",
                  "raise-zero-stage", "offload-last")
OOM_SHORT = ("lower-micro-batch", "activation-checkpointing", "raise-zero-stage", "offload-last")


@dataclass(frozen=True)
class Diagnosis:
    """One known problem found in the input, with everything needed to act on it.

    ``fix`` holds the fix texts in the order to try them (``fix_ids`` names them); ``finding`` is
    what this particular log says beyond the entry (the OOM numbers, which rank failed first).
    """

    entry_id: str
    title: str
    severity: str
    family: str
    cause: str
    fix: tuple[str, ...]
    patch: str | None
    patch_kind: str | None
    sources: tuple[str, ...]
    checked_against: str
    line_no: int
    snippet: str
    count: int
    details: dict[str, str]
    fix_ids: tuple[str, ...] = ()
    finding: str = ""
    offset: int = field(default=0, compare=False)
    #: the evidence it was named on (patterns, facts, claims), for ``explain --why``
    evidence: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict:
        """A JSON-ready dict (for ``--json`` and the Jupyter extension)."""
        return {
            "id": self.entry_id, "title": self.title, "severity": self.severity,
            "family": self.family, "line": self.line_no, "snippet": self.snippet,
            "count": self.count, "details": self.details, "cause": self.cause,
            "finding": self.finding, "fix": list(self.fix), "fix_ids": list(self.fix_ids),
            "patch": self.patch, "patch_kind": self.patch_kind,
            "sources": list(self.sources), "checked_against": self.checked_against,
            "evidence": list(self.evidence),
        }


class _Unfilled(dict):
    """Placeholders the log does not fill show as <name>."""

    def __missing__(self, key: str) -> str:
        return f"<{key}>"


def _filled(text: str, details: dict[str, str]) -> str:
    """A fix text with the {placeholders} this log's details fill (the others as <name>)."""
    try:
        return text.format_map(_Unfilled(details))
    except (ValueError, IndexError, AttributeError, KeyError):  # a format spec on a missing value
        return text


def _fillable(entry: knowledge.Entry, details: dict[str, str]) -> tuple[knowledge.Fix, ...]:
    """The fixes this log can fill: a template for another tool (the doctor's {paths}, {limit})
    needs values a log does not carry, so it is left out. Braces that are no placeholder name
    (a Python dict in a code fix) do not count."""
    return tuple(f for f in entry.fixes
                 if {p for p in f.placeholders() if p.isidentifier()} <= details.keys())


def _diagnosis(c: Claimed, data: Input) -> Diagnosis:
    m = c.match
    e = m.entry
    return Diagnosis(
        entry_id=e.id, title=e.title, severity=e.severity, family=e.family, cause=e.cause,
        fix=tuple(_filled(f.text, m.details) for f in _fillable(e, m.details)),
        fix_ids=tuple(f.id for f in _fillable(e, m.details)), patch=e.patch, patch_kind=e.patch_kind,
        sources=e.sources, checked_against=e.checked_against, line_no=data.input_line(m.line_no),
        snippet=m.snippet, count=m.count, details=m.details, offset=m.offset, evidence=c.evidence,
    )


def _with_fixes(d: Diagnosis, fix_ids: tuple[str, ...]) -> Diagnosis:
    entry = knowledge.get(d.entry_id)
    return replace(d, fix_ids=fix_ids, fix=tuple(_filled(entry.get_fix(i).text, d.details) for i in fix_ids))


def _refine_oom(d: Diagnosis, text: str) -> Diagnosis:
    """Order the OOM fixes by what the message's numbers show; say the numbers."""
    numbers = parse_oom(text)
    if numbers is None:
        return d
    sizes = {"requested": numbers.requested, "free": numbers.free, "total": numbers.total,
             "allocated": numbers.allocated,
             "reserved_unallocated": numbers.reserved_unallocated}
    details = {**d.details, **{k: format_bytes(v) for k, v in sizes.items() if v is not None}}
    refined = replace(d, details=details, finding=numbers.summary())
    if numbers.reserved_unallocated is None:  # the numbers cannot tell: keep "measure" first
        return refined
    return _with_fixes(refined, OOM_FRAGMENTED if numbers.fragmentation else OOM_SHORT)


def _judge_fp16(d: Diagnosis, data: Input) -> Diagnosis | None:
    """fp16 overflows: a diagnosis only for a collapse, not for the routine loss-scale search."""
    reason = loss_scale.collapse(loss_scale.history(data.text))
    return replace(d, finding=f"Counted in this log: {reason}") if reason else None


def _judge_router(d: Diagnosis, data: Input) -> Diagnosis | None:
    """An expert-load or top-k printout: a diagnosis only when it shows a collapsed router."""
    found = expert_load.find_collapse(data.text)
    if found is None:
        return None
    line_no, snippet = line_at(data.text, found.offset)
    return replace(d, finding=f"This printout shows it: {found.summary}", offset=found.offset,
                   line_no=data.input_line(line_no), snippet=snippet)


#: Entries whose patterns only find candidates: the log's numbers decide (None: not a problem).
JUDGES = {"fp16-moe": _judge_fp16, "router-collapse": _judge_router}


def _judged(c: Claimed, data: Input) -> Diagnosis | None:
    """The diagnosis, after its judge (if any) read the log; our own messages need no judge."""
    d = _diagnosis(c, data)
    judge = JUDGES.get(d.entry_id)
    return judge(d, data) if judge is not None and not is_own(c.match) else d


def _line_of(data: Input, offset: int) -> int:
    return data.input_line(data.text.count("\n", 0, offset) + 1)


def _followed_fixes(d: Diagnosis, data: Input, norm: Normalized, ev: evidence.Evidence) -> Diagnosis:
    """Leave out fixes the log shows were followed, or that cannot help here, and say why."""
    if not d.fix_ids:
        return d
    entry = knowledge.get(d.entry_id)
    keep: list[str] = []
    notes: list[str] = []
    for fix_id in d.fix_ids:
        f = entry.get_fix(fix_id)
        wanted = log_facts.fix_assignments(_filled(f.text, d.details))
        settings = [(v, s) for name, v in wanted
                    if (s := log_facts.env_setting(data.text, name)) is not None and s.value is not None]
        done = [s for v, s in settings if log_facts.same_value(v, s.value)]
        followed = bool(wanted) and len(done) == len(wanted)  # every variable it sets is set so
        notes += [f"Line {_line_of(data, s.offset)} already sets {s.name}={s.value}"
                  + (": that step was followed, so it is not proposed again." if followed else ".")
                  for s in done]
        notes += [f"Line {_line_of(data, s.offset)} sets {s.name}={s.value}." for v, s in settings
                  if s not in done]
        blocked = (bool(f.skip_when) and re.search(f.skip_when, data.text, re.I | re.M) is not None
                   or any(holds(t, ev, norm) is not None for t in f.skip_on))
        if blocked:
            notes.append(f.skip_why)
        if not followed and not blocked:
            keep.append(fix_id)
    if not notes:
        return d
    finding = " ".join(filter(None, (d.finding, *dict.fromkeys(notes))))
    return replace(_with_fixes(d, tuple(keep)), finding=finding)


def _rank_of(snippet: str) -> str | None:
    """The rank a log line comes from, when torch prefixed it (``[rank1]: ...``)."""
    hit = _RANK_PREFIX.match(snippet)
    return hit.group(1) if hit else None


def _orphan_finding(echo: Diagnosis, data: Input) -> str:
    """What an echo means when no rank's own error (a known one) is in the log."""
    abort = log_facts.first_abort(data.text, before=echo.offset)  # an abort before the echo
    if abort is not None:
        what = f" ({abort.what})" if abort.what else ""
        return (f"A rank aborted in C++ without a Python traceback at line {_line_of(data, abort.offset)}: "
                f"terminate called after throwing an instance of '{abort.thrown}'{what}. That abort is "
                "the first error; the failures after it only followed from it.")
    code = echo.details.get("exitcode")
    if code in ("-9", "137"):
        return (f"No rank's own error is in this log, and rank {echo.details.get('failed_rank', '?')} "
                f"exited with code {code} (SIGKILL): it was killed, most often by the out-of-memory "
                "killer.")
    return ("No rank's own error is in this log: the rank that failed first left no traceback "
            "here (killed, or its output went to another file).")


def _link_echoes(found: list[Diagnosis], data: Input) -> list[Diagnosis]:
    """Say which failure caused the others: a rank's own error before the ranks that followed it."""
    echoes = [d for d in found if d.family == ECHO_FAMILY and d.severity == "error"]
    roots = [d for d in found if d.family != ECHO_FAMILY and d.severity == "error"]
    if not echoes:
        return found
    if not roots:
        return [replace(d, finding=_orphan_finding(d, data)) if d.entry_id == PEER_ENTRY else d
                for d in found]
    # The first failing rank's error comes before the echoes it caused; take the earliest root
    # that precedes the first echo, else the top-ranked one. A root whose entry another named root
    # explains (its evidence's ``explains``) is that one's consequence, not the first failure.
    first_echo = min(e.offset for e in echoes)
    explained = {i for r in roots for i in knowledge.get(r.entry_id).evidence.explains}
    before = [r for r in roots if r.offset < first_echo]
    before = [r for r in before if r.entry_id not in explained] or before
    root = min(before, key=lambda r: r.offset) if before else roots[0]
    rank = _rank_of(root.snippet)
    echo_lines = "; ".join(f"line {e.line_no}: {e.title.lower()}" for e in echoes)
    out = []
    for d in found:
        if d is root:
            who = f"rank {rank}'s" if rank is not None else "the first failing rank's"
            link = (f"This is {who} own error; the failures after it ({echo_lines}) only "
                    "followed from it." if root.offset < first_echo else
                    f"The other failures in this log ({echo_lines}) only followed from this one.")
            d = replace(d, finding=" ".join(filter(None, (d.finding, link))))
        elif d in echoes:
            d = replace(d, finding=(f"This followed from the error at line {root.line_no} "
                                    f"({root.entry_id}): fix that one first."))
        out.append(d)
    return ([d for d in out if d.entry_id == root.entry_id]
            + [d for d in out if d.entry_id != root.entry_id])


@lru_cache(maxsize=1)
def _vocabulary() -> frozenset[str]:
    """Identifiers with underscores the knowledge base's patterns, symptoms and evidence terms
    name (a term's ``sigkill_handler`` is repaired in a paste that says ``sigkill handler``)."""
    return identifier_vocabulary(s for e in knowledge.load_entries()
                                 for s in (*e.patterns, *e.contextual, *e.context, *e.symptoms,
                                           *_terms(e)))


@lru_cache(maxsize=1)
def _words() -> frozenset[str]:
    """The long words the knowledge base's patterns and symptoms quote (the libraries' messages),
    whose misspellings in a retyped error line are repaired."""
    return word_vocabulary(s for e in knowledge.load_entries() for s in (*e.patterns, *e.contextual, *e.symptoms))


def _terms(entry: knowledge.Entry) -> tuple[str, ...]:
    """Every evidence term of an entry, without its ``kind:``."""
    rules = entry.evidence
    terms = (*rules.requires, *rules.excludes, *(t for c in rules.claims for t in (*c.when, *c.unless)))
    return tuple(t.partition(":")[2] for t in terms)


def _read(data: Input) -> tuple[Normalized, evidence.Evidence]:
    norm = normalize(data.text, _vocabulary(), words=_words())
    return norm, evidence.collect(norm)


def explain_input(data: Input) -> list[Diagnosis]:
    """Diagnoses for what was read, best first; an empty list when nothing is known."""
    norm, ev = _read(data)
    claims = decide(data.text, norm, ev, knowledge.load_entries())
    broad = {c.match.entry.id for c in claims if c.broad}
    found = [_judged(c, data) for c in claims]
    found = [_refine_oom(d, data.text) if d.entry_id == OOM_ENTRY else d for d in found if d is not None]
    found = [_followed_fixes(d, data, norm, ev) for d in found]
    # a broad claim stands only where one of its fixes applies to this report
    found = [d for d in found if d.entry_id not in broad or d.fix_ids]
    return _link_echoes(found, data)


@dataclass(frozen=True)
class Recognised:
    """What a report showed when no known problem fits it: one sentence and the facts."""

    summary: str
    facts: tuple[evidence.Fact, ...]
    normalised: tuple[str, ...]  # the normalising steps that changed the text

    def to_dict(self) -> dict:
        """A JSON-ready dict (for ``--json``)."""
        return {"summary": self.summary, "facts": [f.describe() for f in self.facts],
                "normalised": list(self.normalised)}


def recognised(data: Input) -> Recognised:
    """What the report shows, for the message when :func:`explain_input` found nothing."""
    norm, ev = _read(data)
    return Recognised(evidence.summary(ev), evidence.helpful(ev), norm.steps)


def explain_text(text: str) -> list[Diagnosis]:
    """Diagnoses for a log or traceback given as a string, best first."""
    return explain_input(from_text(text))
