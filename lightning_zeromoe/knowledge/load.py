"""Loading the knowledge base: parse and validate ``entries/<id>.toml``, once per process.

``load_entries()`` raises :class:`~lightning_zeromoe.knowledge.model.KnowledgeError` naming the
file and the field for any violation, so a broken entry fails the test suite instead of a user's
session. ``get``, ``fix`` and ``message`` are the citation API (see the package docstring).
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib

try:  # the regex parser; used only to find each pattern's required literal text
    from re import _parser as _sre_parse  # Python >= 3.11
    from re._constants import LITERAL as _LITERAL
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]
    from sre_constants import LITERAL as _LITERAL  # type: ignore[no-redef]
from functools import lru_cache
from pathlib import Path

from lightning_zeromoe.knowledge.model import (
    CONTEXT_CHARS, EVIDENCE_KINDS, FAMILIES, PATCH_KINDS, SEVERITIES, Claim, Entry, EvidenceRules, Fix, KnowledgeError,
    Message,
)

__all__ = ["ENTRIES_DIR", "anchor_of", "fix", "get", "load_entries", "load_entry", "message"]

#: Where the entries live: inside this package, so ``lightning_zeromoe`` reads them without the
#: troubleshooter, and they ship with the wheel (pyproject's package-data).
ENTRIES_DIR = Path(__file__).with_name("entries")

_REGEX_FLAGS = re.IGNORECASE | re.MULTILINE
_ID_RE = re.compile(r"^[a-z0-9]+(?:[.-][a-z0-9]+)*$")
_STR_FIELDS = ("id", "title", "family", "severity", "checked_against", "cause")
_LIST_FIELDS = ("symptoms", "patterns", "sources")
_OPTIONAL = ("patch", "patch_kind", "contextual", "context", "context_chars", "evidence")
_FIX_KEYS = frozenset({"id", "text", "skip_when", "skip_on", "skip_why"})


def _fail(path: Path, key: str, problem: str) -> KnowledgeError:
    return KnowledgeError(f"{path.name}: field '{key}': {problem}")


def _check_strings(path: Path, data: dict) -> None:
    for key in _STR_FIELDS:
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            raise _fail(path, key, "missing or not a non-empty string")
    for key in _LIST_FIELDS:
        value = data.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise _fail(path, key, "missing or not a list of non-empty strings")
        if key != "patterns" and not value:
            raise _fail(path, key, "must have at least one item")


def _check_values(path: Path, data: dict) -> None:
    unknown = set(data) - set(_STR_FIELDS) - set(_LIST_FIELDS) - set(_OPTIONAL) - {"fixes", "messages"}
    if unknown:
        raise _fail(path, sorted(unknown)[0], "unknown field")
    if data["id"] != path.stem or not _ID_RE.match(data["id"]):
        raise _fail(path, "id", f"must equal the file stem {path.stem!r} (lower-case, '-' separated)")
    if data["family"] not in FAMILIES:
        raise _fail(path, "family", f"{data['family']!r} is not one of {sorted(FAMILIES)}")
    if data["severity"] not in SEVERITIES:
        raise _fail(path, "severity", f"{data['severity']!r} is not one of {list(SEVERITIES)}")


def _parse_templates(path: Path, data: dict, key: str, cls: type[Fix]) -> tuple:
    """The ``[[fixes]]`` (required) or ``[[messages]]`` (optional) tables of an entry."""
    raw = data.get(key)
    if raw is None and key == "messages":
        return ()
    if not isinstance(raw, list) or not raw:
        raise _fail(path, key, f"missing: add at least one [[{key}]] table with 'id' and 'text'")
    items: list[Fix] = []
    for i, item in enumerate(raw):
        allowed = _FIX_KEYS if cls is Fix else {"id", "text"}
        if not isinstance(item, dict) or not {"id", "text"} <= set(item) <= allowed:
            raise _fail(path, key, f"table {i + 1} must have the keys 'id' and 'text'"
                        + (" (and optionally 'skip_when' or 'skip_on' with 'skip_why')" if cls is Fix else " only"))
        item_id, text = item["id"], item["text"]
        if not isinstance(item_id, str) or not _ID_RE.match(item_id):
            raise _fail(path, key, f"table {i + 1}: id {item_id!r} must be a lower-case slug ('-' separated)")
        if not isinstance(text, str) or not text.strip():
            raise _fail(path, key, f"table {i + 1} ({item_id}): text missing or empty")
        if any(f.id == item_id for f in items):
            raise _fail(path, key, f"id {item_id!r} is used twice")
        template = cls(item_id, text.strip(), data["id"], *_skip(path, key, i, item))
        try:
            template.placeholders()
        except ValueError as err:
            raise _fail(path, key, f"table {i + 1} ({item_id}): bad placeholder: {err}") from None
        items.append(template)
    return tuple(items)


def _skip(path: Path, key: str, i: int, item: dict) -> tuple[str, str, tuple[str, ...]]:
    """A fix's optional (skip_when, skip_why, skip_on): skip_why with skip_when (a regex that compiles),
    skip_on (evidence terms) or both, and neither without skip_why."""
    if not {"skip_when", "skip_on", "skip_why"} & set(item):
        return "", "", ()
    when, why, on = item.get("skip_when", ""), item.get("skip_why"), item.get("skip_on")
    if not (isinstance(why, str) and why.strip() and isinstance(when, str) and (when.strip() or on)):
        raise _fail(path, key, f"table {i + 1}: skip_why goes with skip_when or skip_on, as non-empty strings")
    try:
        re.compile(when, _REGEX_FLAGS)
    except re.error as err:
        raise _fail(path, key, f"table {i + 1}: skip_when does not compile: {err}") from None
    terms = _terms(path, f"{key}.skip_on", on) if on is not None else ()
    return when, " ".join(why.split()), terms


def _check_context(path: Path, data: dict) -> None:
    """contextual and context go together; context_chars is a positive integer."""
    for key in ("contextual", "context"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise _fail(path, key, "not a list of non-empty strings")
    if bool(data.get("contextual")) != bool(data.get("context")):
        raise _fail(path, "context", "contextual patterns need context patterns, and the reverse")
    chars = data.get("context_chars", CONTEXT_CHARS)
    if isinstance(chars, bool) or not isinstance(chars, int) or chars < 1:
        raise _fail(path, "context_chars", "must be a positive integer")


def _terms(path: Path, key: str, value: object) -> tuple[str, ...]:
    """A list of evidence terms ``kind:regex``: a known kind, a regex that compiles."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise _fail(path, key, "not a list of 'kind:regex' strings")
    for term in value:
        kind, sep, pattern = term.partition(":")
        if not sep or kind not in EVIDENCE_KINDS:
            raise _fail(path, key, f"{term!r}: a term is 'kind:regex' with kind one of {sorted(EVIDENCE_KINDS)}")
        try:
            re.compile(pattern, _REGEX_FLAGS)
        except re.error as err:
            raise _fail(path, key, f"{term!r} does not compile: {err}") from None
    return tuple(value)


def _parse_evidence(path: Path, data: dict) -> EvidenceRules:
    """The optional ``[evidence]`` table (see EvidenceRules)."""
    raw = data.get("evidence")
    if raw is None:
        return EvidenceRules()
    if not isinstance(raw, dict) or set(raw) - {"requires", "excludes", "broad", "claims", "explains"}:
        raise _fail(path, "evidence", "a table with only requires, excludes, broad, explains and [[evidence.claims]]")
    explains = raw.get("explains", [])
    if not isinstance(explains, list) or not all(isinstance(i, str) and _ID_RE.match(i) for i in explains):
        raise _fail(path, "evidence.explains", "must be a list of entry ids")
    if not isinstance(raw.get("broad", False), bool):
        raise _fail(path, "evidence.broad", "must be true or false")
    claims = []
    for i, item in enumerate(raw.get("claims", [])):
        if not isinstance(item, dict) or not {"why", "when"} <= set(item) <= {"why", "when", "unless", "broad"}:
            raise _fail(path, "evidence.claims", f"claim {i + 1} needs 'why' and 'when' (and optionally "
                                                 "'unless', 'broad')")
        if not isinstance(item["why"], str) or not item["why"].strip() or not item["when"]:
            raise _fail(path, "evidence.claims", f"claim {i + 1}: 'why' and 'when' must not be empty")
        claims.append(Claim(" ".join(item["why"].split()), _terms(path, "evidence.claims.when", item["when"]),
                            _terms(path, "evidence.claims.unless", item.get("unless", [])),
                            bool(item.get("broad", False))))
    return EvidenceRules(_terms(path, "evidence.requires", raw.get("requires", [])),
                         _terms(path, "evidence.excludes", raw.get("excludes", [])),
                         raw.get("broad", False), tuple(claims), tuple(explains))


def _check_patch(path: Path, data: dict) -> None:
    patch, kind = data.get("patch"), data.get("patch_kind")
    if patch is None and kind is None:
        return
    if not isinstance(patch, str) or not patch.strip():
        raise _fail(path, "patch", "patch_kind is set but patch is missing or empty")
    if kind not in PATCH_KINDS:
        raise _fail(path, "patch_kind", f"must be one of {sorted(PATCH_KINDS)} when patch is present")
    if kind == "json":
        try:
            parsed = json.loads(patch)
        except json.JSONDecodeError as err:
            raise _fail(path, "patch", f"not valid JSON ({err.msg} at {err.lineno}:{err.colno})")
        if not isinstance(parsed, dict):
            raise _fail(path, "patch", "a JSON patch must be an object")


def _compile(path: Path, patterns: list[str], key: str = "patterns") -> tuple[re.Pattern[str], ...]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern, _REGEX_FLAGS))
        except re.error as err:
            raise _fail(path, key, f"{pattern!r} does not compile: {err}")
    return tuple(compiled)


def anchor_of(pattern: str) -> str:
    """The longest run of plain characters at the top level of ``pattern``, lower-cased.

    Every match of the pattern contains it, so when the lowered text does not, the (slower,
    case-insensitive) regex need not run. Returns "" when the pattern has no such run.
    """
    best = run = ""
    for op, arg in _sre_parse.parse(pattern):
        if op == _LITERAL:
            run += chr(arg)
            best = max(best, run, key=len)
        else:
            run = ""
    return best.lower()


def load_entry(path: Path) -> Entry:
    """Parse and validate one entry file."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise KnowledgeError(f"{path.name}: not valid TOML: {err}") from None
    _check_strings(path, data)
    _check_values(path, data)
    _check_patch(path, data)
    _check_context(path, data)
    fixes = _parse_templates(path, data, "fixes", Fix)
    messages = _parse_templates(path, data, "messages", Message)
    return Entry(
        id=data["id"], title=data["title"], family=data["family"], severity=data["severity"],
        checked_against=data["checked_against"], symptoms=tuple(data["symptoms"]),
        patterns=tuple(data["patterns"]), cause=data["cause"].strip(), fixes=fixes,
        sources=tuple(data["sources"]), messages=messages, patch=data.get("patch"), patch_kind=data.get("patch_kind"),
        compiled=_compile(path, data["patterns"]),
        anchors=tuple(anchor_of(p) for p in data["patterns"]),
        contextual=tuple(data.get("contextual", ())), context=tuple(data.get("context", ())),
        context_chars=data.get("context_chars", CONTEXT_CHARS),
        compiled_contextual=_compile(path, data.get("contextual", []), "contextual"),
        contextual_anchors=tuple(anchor_of(p) for p in data.get("contextual", ())),
        compiled_context=_compile(path, data.get("context", []), "context"),
        context_anchors=tuple(anchor_of(p) for p in data.get("context", ())),
        evidence=_parse_evidence(path, data),
    )


@lru_cache(maxsize=1)
def load_entries() -> tuple[Entry, ...]:
    """Every entry, sorted by id. Cached: the files are read once per process."""
    return tuple(load_entry(p) for p in sorted(ENTRIES_DIR.glob("*.toml")))


@lru_cache(maxsize=1)
def _by_id() -> dict[str, Entry]:
    return {entry.id: entry for entry in load_entries()}


def get(entry_id: str) -> Entry:
    """The entry with this id; a KeyError that lists the closest ids when there is none."""
    entries = _by_id()
    try:
        return entries[entry_id]
    except KeyError:
        close = difflib.get_close_matches(entry_id, list(entries), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no knowledge-base entry {entry_id!r}{hint}") from None


def fix(entry_id: str, fix_id: str) -> Fix:
    """The fix ``fix_id`` of entry ``entry_id``: how code cites advice (never by list position)."""
    return get(entry_id).get_fix(fix_id)


def message(entry_id: str, message_id: str) -> Message:
    """The message template ``message_id`` of entry ``entry_id`` (what a tool reports)."""
    return get(entry_id).get_message(message_id)
