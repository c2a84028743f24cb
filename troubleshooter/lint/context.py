"""What every lint rule shares: the parsed config, the consumer, and how a finding is made.

A finding's message and fix are never written here: a rule cites a message template and a fix
of a knowledge-base entry (``knowledge.message`` / ``knowledge.fix``) and fills them with what it
found. The entry of the message is the finding's ``rule``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from troubleshooter.knowledge import Fix, Message
from troubleshooter.lint.source import locate

__all__ = ["CONSUMERS", "Context", "Finding", "get", "is_int", "nested", "type_name"]

#: Who reads the config: DeepSpeed itself (deepspeed.initialize(config=...)), Lightning's
#: DeepSpeedStrategy(config=...), or the Hugging Face Trainer (TrainingArguments(deepspeed=...)).
CONSUMERS = ("deepspeed", "lightning", "hf")
CONSUMER_NAMES = {"deepspeed": "DeepSpeed", "lightning": "Lightning's DeepSpeedStrategy",
                  "hf": "the Hugging Face Trainer"}


@dataclass(frozen=True)
class Finding:
    """One problem in a config. ``rule`` is the id of the knowledge-base entry that explains it;
    ``message_id`` and ``fix_id`` name the templates of that entry the text was made from."""

    rule: str
    severity: str  # error | warning | info
    path: str  # JSON path, e.g. zero_optimization.stage3_prefetch_bucket_size
    message: str
    fix: str
    patch: dict | None = None  # a JSON merge patch (RFC 7386) for the config, when one helps
    message_id: str = ""
    fix_id: str = ""
    fix_entry: str = ""  # the entry the fix belongs to (usually ``rule``)
    line: int | None = None  # 1-based position of the key in the file (None for a dict)
    col: int | None = None
    notes: tuple[str, ...] = ()  # per-key notes (the 'moe' block's keys)
    note_ids: tuple[str, ...] = ()  # the message id each note was made from

    def to_dict(self) -> dict:
        return {"rule": self.rule, "severity": self.severity, "path": self.path,
                "line": self.line, "col": self.col, "message": self.message,
                "message_id": self.message_id, "fix": self.fix, "fix_id": self.fix_id,
                "fix_entry": self.fix_entry, "notes": list(self.notes),
                "note_ids": list(self.note_ids), "patch": self.patch}


@dataclass
class Context:
    """The config being linted and the findings so far."""

    config: dict
    world_size: int | None
    consumer: str
    source: str
    text: str | None = None
    #: JSON paths whose value has the wrong type: the rules skip them (one finding each).
    bad_types: set[str] = field(default_factory=set)
    findings: list[Finding] = field(default_factory=list)

    @property
    def consumer_name(self) -> str:
        return CONSUMER_NAMES[self.consumer]

    def add(self, severity: str, path: str, message: Message, fix: Fix, *,
            patch: dict | None = None, notes: tuple[Message, ...] = (),
            at: tuple[int, int] | None = None, **values: Any) -> None:
        """Record a finding: ``message`` and ``fix`` filled with ``values`` plus ``path``, ``key``
        (the last part of the path) and ``value`` (the JSON of the value there, when present).
        ``at`` is the (line, col) when it is not the key's position (a syntax problem).
        ``notes`` are message templates already rendered (``Message`` with the filled text)."""
        filled = {"path": path, "key": path.rsplit(".", 1)[-1], "consumer": self.consumer_name}
        present = get(self.config, path, _MISSING) if path else _MISSING
        if present is not _MISSING:
            filled["value"] = json.dumps(present)
        filled.update(values)
        if at is not None:
            line, col = at
        elif self.text is not None:
            line, col = locate(self.text, path.split(".") if path else [])
        else:
            line, col = None, None
        self.findings.append(Finding(message.entry, severity, path, message.render(**filled),
                                     fix.render(**filled), patch, message.id, fix.id, fix.entry,
                                     line, col, tuple(n.text for n in notes),
                                     tuple(n.id for n in notes)))

    def int_at(self, path: str) -> int | None:
        """An integer setting, or None when absent, "auto" or of the wrong type."""
        value = get(self.config, path)
        return int(value) if path not in self.bad_types and is_int(value) else None

    def enabled(self, path: str) -> bool:
        return get(self.config, path) is True


_MISSING = object()


def get(config: Any, path: str, default: Any = None) -> Any:
    """The value at a dotted path, or ``default`` when a part is missing or not an object."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def is_int(value: Any) -> bool:
    """An integer, or a float with an integral value (DeepSpeed configs write 5e7)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer())


def type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)


def nested(flat: dict[str, Any]) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}: merge patches are nested objects."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out
