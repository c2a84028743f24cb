"""The knowledge base's data model: an :class:`Entry` per known problem, with its :class:`Fix` steps
and :class:`Message` templates. Immutable, shared by every caller through the loader's cache.

Standard library only: ``lightning_zeromoe`` renders its own errors from these, and the
troubleshooter imports them without loading torch, DeepSpeed or Lightning.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field

__all__ = ["CONTEXT_CHARS", "EVIDENCE_KINDS", "FAMILIES", "PATCH_KINDS", "SEVERITIES", "Claim", "Entry",
           "EvidenceRules", "Fix", "KnowledgeError", "Message"]

FAMILIES = frozenset({
    "oom", "router-collapse", "timeout", "install", "native-moe-zero3", "zero3-pitfalls", "autoep",
    "config", "host", "export",
})
SEVERITIES = ("error", "warning", "info")
PATCH_KINDS = frozenset({"json", "diff"})
#: The kinds of fact an evidence term (``kind:regex``) can name; the troubleshooter's evidence
#: module (troubleshooter/evidence.py) produces them from a report.
EVIDENCE_KINDS = frozenset({"error", "type", "frame", "library", "config", "stack", "phase", "number", "trend",
                            "signal", "told", "cut", "code", "text"})
#: How near a context pattern must match to a contextual pattern's hit, unless the entry says.
CONTEXT_CHARS = 50_000


class KnowledgeError(ValueError):
    """An entry file breaks the schema; the message names the file and the field."""


@dataclass(frozen=True)
class Fix:
    """One fix step of an entry, cited by ``(entry id, fix id)``."""

    id: str
    text: str
    entry: str = ""  # the id of the entry it belongs to
    #: A regex: explain leaves this fix out when the log matches it, and says ``skip_why``.
    skip_when: str = ""
    skip_why: str = ""
    #: Evidence terms (``kind:regex``, as in ``[evidence]``): explain leaves this fix out when any holds.
    skip_on: tuple[str, ...] = ()

    def render(self, **values: object) -> str:
        """The text with its ``{placeholders}`` filled in; a missing value raises KeyError."""
        return self.text.format(**values) if values else self.text

    def placeholders(self) -> frozenset[str]:
        """The names of the ``{placeholders}`` in the text."""
        return frozenset(name.split(".")[0].split("[")[0]
                         for _lit, name, _spec, _conv in string.Formatter().parse(self.text) if name)


@dataclass(frozen=True)
class Message(Fix):
    """A finding's message template of an entry, cited by ``(entry id, message id)``."""


@dataclass(frozen=True)
class Claim:
    """One set of evidence that names an entry without its patterns: every ``when`` term holds
    and no ``unless`` term does. ``why`` says it in words; a ``broad`` claim names the entry only
    when no more specific entry is named and at least one of its fixes applies."""

    why: str
    when: tuple[str, ...]
    unless: tuple[str, ...] = ()
    broad: bool = False


@dataclass(frozen=True)
class EvidenceRules:
    """An entry's ``[evidence]`` table: what a report must show besides a pattern hit
    (``requires``, every term), what rules the entry out whatever matched (``excludes``, any
    term), whether its patterns are broad ones (``broad``: named only when nothing more specific
    is), its :class:`Claim` s (``[[evidence.claims]]``), and the ids of the entries whose errors
    its cause also explains (``explains``: when both are named in one report, this one is the
    cause and goes first). Terms are ``kind:regex``."""

    requires: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    broad: bool = False
    claims: tuple[Claim, ...] = ()
    explains: tuple[str, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One known problem. Immutable: entries are shared by every caller through the cache."""

    id: str
    title: str
    family: str
    severity: str
    checked_against: str
    symptoms: tuple[str, ...]
    patterns: tuple[str, ...]
    cause: str
    fixes: tuple[Fix, ...]
    sources: tuple[str, ...]
    messages: tuple[Message, ...] = ()
    patch: str | None = None
    patch_kind: str | None = None
    compiled: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)
    #: Per compiled pattern, a lower-case literal every match must contain ("" when none): a
    #: substring test on the lowered text skips the regex for most patterns on most logs.
    anchors: tuple[str, ...] = field(default=(), repr=False, compare=False)
    contextual: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    context_chars: int = CONTEXT_CHARS
    compiled_contextual: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)
    contextual_anchors: tuple[str, ...] = field(default=(), repr=False, compare=False)
    compiled_context: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)
    context_anchors: tuple[str, ...] = field(default=(), repr=False, compare=False)
    evidence: EvidenceRules = EvidenceRules()

    @property
    def fix(self) -> tuple[str, ...]:
        """The fix texts, in order (placeholders unfilled)."""
        return tuple(f.text for f in self.fixes)

    def get_fix(self, fix_id: str) -> Fix:
        """The fix with this id; a KeyError naming the entry's fix ids when there is none."""
        for f in self.fixes:
            if f.id == fix_id:
                return f
        raise KeyError(f"entry {self.id!r} has no fix {fix_id!r}; its fixes: {', '.join(f.id for f in self.fixes)}")

    def get_message(self, message_id: str) -> Message:
        """The message template with this id; a KeyError naming the entry's message ids."""
        for m in self.messages:
            if m.id == message_id:
                return m
        raise KeyError(f"entry {self.id!r} has no message {message_id!r}; its messages: "
                       f"{', '.join(m.id for m in self.messages) or '(none)'}")

    def patch_json(self) -> dict | None:
        """The patch parsed as a JSON object, when it is a JSON patch."""
        if self.patch is None or self.patch_kind != "json":
            return None
        return json.loads(self.patch)
