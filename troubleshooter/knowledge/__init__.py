"""The knowledge base: one TOML file per known problem, loaded and validated once.

Why data and not code: ``explain``, ``lint``, ``doctor`` and the Jupyter extension all cite the
same entries, and a fact (a message wording, a fix step) is corrected in one file. Entries live in
``troubleshooter/knowledge/entries/<id>.toml`` and are parsed with the standard library's
``tomllib``, so loading the knowledge base imports nothing heavy.

Entry schema (every key is required unless marked optional)::

    id = "native-moe-zero3"           # equals the file stem; lower-case words joined by "-"
    title = "One line that names the problem"
    family = "native-moe-zero3"       # one of FAMILIES below
    severity = "error"                # error | warning | info
    checked_against = "deepspeed 0.19.8 (engine.py read)"   # what was verified, and how
    symptoms = ["what the user sees", ...]                 # at least one
    patterns = ['regex', ...]         # Python regexes, matched case-insensitively and
                                      # multi-line over log text; may be empty for entries that
                                      # only lint or doctor cite. Named groups become details.
                                      # A pattern that uses \Z ("the log ends here") is tried
                                      # on the last TAIL_CHARS characters only.
    cause = '''why it happens'''
    patch = '''{"json": "merge patch"}'''   # optional: a DeepSpeed config patch or a code diff
    patch_kind = "json"               # json | diff; required when patch is present
    sources = ["file::function (version)", "https://..."]  # at least one

    [[fixes]]                         # at the end of the file, one table per fix, ordered:
    id = "lower-micro-batch"          # do the first one first. ``id``: a stable slug, unique in
    text = "Lower ... to {micro}."    # the entry; code cites fixes by id, never by position.
                                      # ``text`` may hold {placeholders} the caller fills in.

    [[messages]]                      # optional, after the fixes: what a tool reports when it
    id = "mismatch"                   # finds this problem (lint, doctor), as a template filled
    text = "{tbs} != {micro} * ..."   # with what was found: cite with knowledge.message(entry, id).

Citation API (the only way code outside this package may hold advice): ``fix(entry_id, fix_id)``
and ``message(entry_id, message_id)`` return a :class:`Fix` / :class:`Message` whose ``render(**values)``
fills the placeholders; both know their ``entry``. ``tests/test_knowledge_citations.py`` finds
every such call statically and fails on an unknown entry or id, and on advice prose outside
this package.

``load_entries()`` raises :class:`KnowledgeError` naming the file and the field for any
violation, so a broken entry fails the test suite instead of a user's session.
"""

from __future__ import annotations

import difflib
import json
import re
import string
import tomllib

try:  # the regex parser; used only to find each pattern's required literal text
    from re import _parser as _sre_parse  # Python >= 3.11
    from re._constants import LITERAL as _LITERAL
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]
    from sre_constants import LITERAL as _LITERAL  # type: ignore[no-redef]
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

__all__ = [
    "FAMILIES",
    "SEVERITIES",
    "Entry",
    "Fix",
    "KnowledgeError",
    "Match",
    "Message",
    "fix",
    "get",
    "load_entries",
    "match",
    "message",
]

ENTRIES_DIR = Path(__file__).with_name("entries")

FAMILIES = frozenset({
    "oom", "router-collapse", "timeout", "install", "native-moe-zero3", "zero3-pitfalls", "autoep",
    "config", "host",
})
SEVERITIES = ("error", "warning", "info")
PATCH_KINDS = frozenset({"json", "diff"})
_REGEX_FLAGS = re.IGNORECASE | re.MULTILINE
_ID_RE = re.compile(r"^[a-z0-9]+(?:[.-][a-z0-9]+)*$")
_STR_FIELDS = ("id", "title", "family", "severity", "checked_against", "cause")
_LIST_FIELDS = ("symptoms", "patterns", "sources")
_OPTIONAL = ("patch", "patch_kind")
#: A snippet longer than this is cut: log lines can be megabytes long (progress bars, tensors).
SNIPPET_CHARS = 300
#: Patterns about the end of a log (they use \Z) only look at this many trailing characters,
#: which bounds their cost whatever the input.
TAIL_CHARS = 16 * 1024


class KnowledgeError(ValueError):
    """An entry file breaks the schema; the message names the file and the field."""


@dataclass(frozen=True)
class Fix:
    """One fix step of an entry, cited by ``(entry id, fix id)``."""

    id: str
    text: str
    entry: str = ""  # the id of the entry it belongs to

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


@dataclass(frozen=True)
class Match:
    """Where one entry matched a text: the last hit, since the error that matters is at the end."""

    entry: Entry
    pattern: str
    line_no: int  # 1-based line of the last hit
    snippet: str  # that line, stripped and cut to SNIPPET_CHARS
    offset: int  # character offset of the last hit
    count: int  # how many hits over all of the entry's patterns
    details: dict[str, str]  # named groups of the last hit (versions, sizes, op names)


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
        if not isinstance(item, dict) or set(item) != {"id", "text"}:
            raise _fail(path, key, f"table {i + 1} must have exactly the keys 'id' and 'text'")
        item_id, text = item["id"], item["text"]
        if not isinstance(item_id, str) or not _ID_RE.match(item_id):
            raise _fail(path, key, f"table {i + 1}: id {item_id!r} must be a lower-case slug ('-' separated)")
        if not isinstance(text, str) or not text.strip():
            raise _fail(path, key, f"table {i + 1} ({item_id}): text missing or empty")
        if any(f.id == item_id for f in items):
            raise _fail(path, key, f"id {item_id!r} is used twice")
        template = cls(item_id, text.strip(), data["id"])
        try:
            template.placeholders()
        except ValueError as err:
            raise _fail(path, key, f"table {i + 1} ({item_id}): bad placeholder: {err}") from None
        items.append(template)
    return tuple(items)


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


def _compile(path: Path, patterns: list[str]) -> tuple[re.Pattern[str], ...]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern, _REGEX_FLAGS))
        except re.error as err:
            raise _fail(path, "patterns", f"{pattern!r} does not compile: {err}")
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
    fixes = _parse_templates(path, data, "fixes", Fix)
    messages = _parse_templates(path, data, "messages", Message)
    return Entry(
        id=data["id"], title=data["title"], family=data["family"], severity=data["severity"],
        checked_against=data["checked_against"], symptoms=tuple(data["symptoms"]),
        patterns=tuple(data["patterns"]), cause=data["cause"].strip(), fixes=fixes,
        sources=tuple(data["sources"]), messages=messages, patch=data.get("patch"), patch_kind=data.get("patch_kind"),
        compiled=_compile(path, data["patterns"]),
        anchors=tuple(anchor_of(p) for p in data["patterns"]),
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


def _line_at(text: str, offset: int) -> tuple[int, str]:
    """1-based line number and the (cut) line that contains ``offset``."""
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    line = text[start:end if end != -1 else len(text)].strip()
    if len(line) > SNIPPET_CHARS:
        line = line[:SNIPPET_CHARS - 1] + "…"
    return text.count("\n", 0, offset) + 1, line


def _match_entry(entry: Entry, text: str, lowered: str) -> Match | None:
    last: re.Match[str] | None = None
    last_pattern = ""
    count = 0
    for pattern, anchor in zip(entry.compiled, entry.anchors):
        if anchor and anchor not in lowered:
            continue
        start = max(0, len(text) - TAIL_CHARS) if r"\Z" in pattern.pattern else 0
        for hit in pattern.finditer(text, start):
            count += 1
            if last is None or hit.start() > last.start():
                last, last_pattern = hit, pattern.pattern
    if last is None:
        return None
    line_no, snippet = _line_at(text, last.start())
    details = {k: v for k, v in last.groupdict().items() if v}
    return Match(entry, last_pattern, line_no, snippet, last.start(), count, details)


def _rank(m: Match) -> tuple:
    """Sort key, best first.

    Errors before warnings before infos. A collective timeout ranks after any other error:
    when one rank dies (OOM, an assertion), the others time out waiting for it, so the timeout
    is usually the echo and the other error the cause. Then the later hit first, because the
    error that stopped the run is at the end of the log.
    """
    is_echo = m.entry.family == "timeout"
    return (SEVERITIES.index(m.entry.severity), is_echo, -m.offset, m.entry.id)


def match(text: str) -> list[Match]:
    """The entries whose patterns occur in ``text``, best first (see ``_rank``)."""
    lowered = text.lower()
    found = [m for entry in load_entries() if (m := _match_entry(entry, text, lowered)) is not None]
    return sorted(found, key=_rank)
