"""Static scan of both packages, ``lightning_zeromoe`` and ``troubleshooter``, for knowledge-base
citations and for advice written outside the knowledge base (used by tests/test_knowledge_citations.py).

A citation is a call of the citation API with the entry (and fix / message) id as arguments:
``knowledge.fix(entry, fix)``, ``knowledge.message(entry, message)``, ``knowledge.get(entry)``,
``knowledge.say(entry, message, *fixes, **values)`` / ``knowledge.compose(...)`` (the project's own
errors and warnings; also as bare names through ``from lightning_zeromoe.knowledge import say``, or
from ``troubleshooter.knowledge``), an ``entry="id"`` keyword, or a walkthrough step
``Step(title, "entry-id", ("fix-id", ...), ...)`` (``troubleshooter/walkthroughs``): its fix ids are
citations, resolved by ``Step.advice``, the one place allowed to pass ids it received (``RESOLVERS``).
An id argument may be a literal, ``a if c else b`` of literals, a module-level string constant (also
one imported from another module of the two packages: ``from ...errors import NOT_A_CHECKPOINT``),
a lookup in a module-level dict of literals (``NOTES.get(key, "default")``, ``NOTES[key]``), or the
variable of a loop over a module-level tuple of literals: all its possible values are checked.
Anything else is reported as unresolved (except ``get(variable)``: a lookup of an id that came from
data, such as a finding's rule, not a citation).

The values a citation fills its templates with are known when they are keywords of ``say`` /
``compose``, or of ``.render(...)`` called on the citation itself; ``values`` is None otherwise
(``**values``, or a template handed on unrendered).

Advice prose is a string literal (not a docstring, not argparse help) that holds a sentence
starting with an imperative fix verb ("Set ...", "Delete ...", "Save ..."), a string given as a
``fix=`` / ``why=`` keyword, a copy of a knowledge-base text, or (our own messages) a hand-made
``[<entry-id>] ...`` message: the prefix is ``knowledge.say``'s alone.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "troubleshooter"
LIBRARY = ROOT / "lightning_zeromoe"
PACKAGES = (LIBRARY, PACKAGE)
#: The knowledge base itself (model, loader, matching, entries): the one place advice may be written.
KNOWLEDGE_DIRS = (LIBRARY / "knowledge", PACKAGE / "knowledge")
KNOWLEDGE = PACKAGE / "knowledge"  # kept for callers of the troubleshooter-only scan

_VERBS = ("Set|Use|Remove|Delete|Rename|Install|Lower|Raise|Choose|Pick|Move|Add|Make|Upgrade|"
          "Downgrade|Pin|Reinstall|Enable|Disable|Replace|Export|Increase|Reduce|Pass|Try|"
          "Unset|Give|Keep|Apply|Prefer|Avoid|Consider|Mount|Point|Build|Pre-build|Wrap|Switch|"
          "Drop|Free|Restart|Rebuild|Clear|Lint|"
          # calibrated on lightning_zeromoe's own messages (every fix sentence they held before
          # they cited the knowledge base starts with one of the verbs above or below)
          "Save|Load|Log|Describe|Return|Copy|Create|Convert|Resume|Freeze|Wait|Call|Run|"
          "Include|Merge|Register|Cast|Report|Re-run|Put|Split|Write")
#: A sentence that starts with a fix verb and goes on for at least two more words.
ADVICE_RE = re.compile(r"(?:^|[.;:!?]\s+|\(\s*|\n\s*)(?:Or |Then |Instead, )?(?:" + _VERBS
                       + r")\s+[\w'\"`{(./-]\S*")
#: In ``lightning_zeromoe``'s messages a fix also hides lower-case after a colon, a semicolon, ", or"
#: or "If ...,": "...is not a ZeRO stage; use 0, 1, 2 or 3", "If you trust it, pass --trust-checkpoint".
#: (Calibrated on the library's messages before they cited the knowledge base: 42 such sentences,
#: and no false hit in what the library says today outside advice.)
LOWER_ADVICE_RE = re.compile(
    r"(?:[;:]|, or|\bIf [^.;]*,)\s+(?:or\s+|then\s+)?(?:set|use|remove|delete|rename|install|lower|raise|choose|"
    r"pick|move|pass|drop|free|save|load|freeze|resume|copy|keep|write|wait|return|call|run|describe|add|replace|"
    r"upgrade|pin|restart|rebuild|try)\s+[\w'\"`{(./-]\S*\s+\S+")
#: The start of one of our own messages: ``[<entry-id>] `` (what ``knowledge.say`` writes).
OWN_PREFIX_RE = re.compile(r"^\[(?P<id>[a-z0-9]+(?:[.-][a-z0-9]+)*|\{\})\] (?P<rest>.*)", re.S)
#: Keywords whose string value is documentation of the interface, not advice about a problem.
DOC_KEYWORDS = {"help", "description", "epilog", "metavar", "usage", "prog", "title"}
#: Positional arguments that are UI labels (a step's title and check-button label, a button's
#: caption, a walkthrough's title), not advice: short names of what a step does.
LABEL_ARGS = {"Step": (0, 3), "Walkthrough": (1,), "_button": (0,)}
#: Keywords whose string value is advice by definition (it must be a citation instead).
ADVICE_KEYWORDS = {"fix", "fixes", "why", "advice", "hint"}
#: The citation functions, by the name they are defined with.
API = {"fix", "message", "get", "say", "compose"}
_KNOWLEDGE_MODULES = {"troubleshooter.knowledge", "lightning_zeromoe.knowledge"}


#: (file, function) pairs that resolve ids checked elsewhere: ``Step.advice`` looks up the fix ids
#: every ``Step(...)`` construction cites, and those constructions are scanned as citations.
RESOLVERS = {("troubleshooter/walkthroughs/base.py", "advice")}


@dataclass(frozen=True)
class Citation:
    path: str
    line: int
    kind: str  # "fix" | "message" | "entry" | "say" (a message and its fixes: say / compose)
    entries: tuple[str, ...]  # possible entry ids ( () when unresolved )
    ids: tuple[str, ...]  # possible fix/message ids (empty for "entry"; message ids for "say")
    unresolved: bool = False
    #: "say": the possible fix ids of each fix argument, in order.
    fixes: tuple[tuple[str, ...], ...] = ()
    #: The keyword names the templates are filled with; None when not known statically.
    values: frozenset[str] | None = None


@dataclass(frozen=True)
class Prose:
    path: str
    line: int
    text: str
    why: str


def _module_of(path: Path) -> str | None:
    try:
        rel = path.resolve().relative_to(ROOT).with_suffix("")
    except ValueError:
        return None
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@lru_cache(maxsize=None)
def _module_constants(module: str) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` of a module of the two packages."""
    base = ROOT.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        return {}
    out = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def _names(tree: ast.Module, path: Path) -> dict[str, tuple[str, ...]]:
    """Names whose possible string values are known: module-level dicts of literals (their
    values), tuples of literals, string constants (local or imported from the two packages), and
    the variables of loops over such tuples."""
    out: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            values: tuple[str, ...] | None = None
            if isinstance(value, ast.Dict) and value.values:
                items = value.values
            elif isinstance(value, (ast.Tuple, ast.List)) and value.elts:
                items = value.elts
            elif isinstance(value, ast.Constant) and isinstance(value.value, str):
                items = [value]
            else:
                items = []
            if items and all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in items):
                values = tuple(v.value for v in items)
            for t in targets:
                if isinstance(t, ast.Name) and values is not None:
                    out[t.id] = values
    for node in ast.walk(tree):  # imported constants, also inside functions (lazy imports)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in ("lightning_zeromoe", "troubleshooter"):
            constants = _module_constants(node.module)
            for a in node.names:
                if a.name in constants:
                    out.setdefault(a.asname or a.name, (constants[a.name],))
    for node in ast.walk(tree):  # for x in TUPLE / (... for x in TUPLE)
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, ast.Name) and node.iter.id in out:
            out.setdefault(node.target.id, out[node.iter.id])
    return out


def _values(node: ast.AST, names: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    """Every string the expression can be, or None when that is not known statically."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Tuple):
        parts = [_values(e, names) for e in node.elts]
        return None if any(p is None for p in parts) else tuple(v for p in parts for v in p)
    if isinstance(node, ast.IfExp):
        a, b = _values(node.body, names), _values(node.orelse, names)
        return None if a is None or b is None else a + b
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names:
        return names[node.value.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
        default = _values(node.args[1], names) if len(node.args) > 1 else ()
        return None if default is None else names[node.func.value.id] + default
    return None


def _aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to the knowledge module, and names bound to its functions (alias -> name)."""
    modules: set[str] = set()
    funcs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("troubleshooter", "lightning_zeromoe"):
            modules |= {a.asname or a.name for a in node.names if a.name == "knowledge"}
        elif isinstance(node, ast.ImportFrom) and node.module in _KNOWLEDGE_MODULES:
            funcs.update({a.asname or a.name: a.name for a in node.names if a.name in API})
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name in _KNOWLEDGE_MODULES and a.asname}
    return modules, funcs


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def python_files(packages: tuple[Path, ...] = PACKAGES) -> list[Path]:
    """Every module of ``packages`` outside the knowledge base's own modules."""
    return sorted(p for package in packages for p in package.rglob("*.py")
                  if not any(k == p.parent or k in p.parents for k in KNOWLEDGE_DIRS))


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:  # a file outside the packages (the scanner's own tests)
        return path.as_posix()


def _keywords(call: ast.Call) -> frozenset[str] | None:
    if any(kw.arg is None for kw in call.keywords):  # **values
        return None
    return frozenset(kw.arg for kw in call.keywords)


def citations(path: Path) -> list[Citation]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, funcs = _aliases(tree)
    names = _names(tree, path)
    out: list[Citation] = []
    resolver_calls = {id(sub) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                      and (_rel(path), fn.name) in RESOLVERS for sub in ast.walk(fn)}
    rendered = {id(node.func.value): _keywords(node) for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "render" and isinstance(node.func.value, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == "Step" and len(node.args) >= 3:
            entries, ids = _values(node.args[1], names), _values(node.args[2], names)
            out.append(Citation(_rel(path), node.lineno, "fix", entries or (), ids or (),
                                entries is None or ids is None))
            continue
        name = None
        if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in modules:
            name = node.func.attr
        elif isinstance(node.func, ast.Name) and node.func.id in funcs:
            name = funcs[node.func.id]
        for kw in node.keywords:
            if kw.arg == "entry" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                out.append(Citation(_rel(path), node.lineno, "entry", (kw.value.value,), ()))
        if name not in API or not node.args:
            continue
        entries = _values(node.args[0], names)
        if name in ("say", "compose"):
            ids = _values(node.args[1], names) if len(node.args) > 1 else None
            fixes = tuple(_values(a, names) for a in node.args[2:])
            unresolved = entries is None or ids is None or any(f is None for f in fixes) \
                or any(isinstance(a, ast.Starred) for a in node.args)
            out.append(Citation(_rel(path), node.lineno, "say", entries or (), ids or (), unresolved,
                                tuple(f or () for f in fixes), _keywords(node)))
            continue
        ids = _values(node.args[1], names) if name != "get" and len(node.args) > 1 else ()
        unresolved = entries is None or ids is None
        if unresolved and id(node) in resolver_calls:
            continue
        if name == "get" and unresolved:
            continue  # get(variable) looks up an id that came from data (a finding's rule)
        out.append(Citation(_rel(path), node.lineno, "entry" if name == "get" else name,
                            entries or (), ids or (), unresolved, values=rendered.get(id(node))))
    return out


def _string_nodes(tree: ast.Module):
    """(node, text, keyword) for every string literal and f-string, with the keyword it is
    passed as (or None). An f-string's placeholders read as ``{}``."""
    parents: dict[int, str | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                for sub in ast.walk(kw.value):
                    parents[id(sub)] = kw.arg
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LABEL_ARGS:
            for i in LABEL_ARGS[node.func.id]:
                if i < len(node.args):
                    skip |= {id(sub) for sub in ast.walk(node.args[i])}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and id(node) not in skip:
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            skip |= {id(v) for v in node.values}
            yield node, text, parents.get(id(node))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node, node.value, parents.get(id(node))


@lru_cache(maxsize=1)
def _entry_ids() -> frozenset[str]:
    return frozenset(p.stem for p in (LIBRARY / "knowledge" / "entries").glob("*.toml"))


def _own_message(text: str) -> bool:
    """``[<entry-id>] <words>``: a hand-made own message (an entry's id, or ``[{}]`` with a text
    of three words or more after it: ``f"[{ENTRY}] ep_size={n} does not ..."``)."""
    found = OWN_PREFIX_RE.match(text)
    if found is None:
        return False
    if found.group("id") == "{}":
        return len(re.findall(r"[A-Za-z]{2,}", found.group("rest"))) >= 3
    return found.group("id") in _entry_ids()


def prose(path: Path, known_texts: list[str], library: bool | None = None) -> list[Prose]:
    """The advice prose in ``path``; ``library``: apply ``lightning_zeromoe``'s stricter rules
    (default: when the file is in that package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    library = LIBRARY in path.resolve().parents if library is None else library
    out: list[Prose] = []
    for node, text, keyword in _string_nodes(tree):
        if id(node) in docs or keyword in DOC_KEYWORDS:
            continue
        line = getattr(node, "lineno", 0)
        if keyword in ADVICE_KEYWORDS and len(text.split()) >= 3:
            out.append(Prose(_rel(path), line, text, f"a hand-written {keyword}= string"))
        elif _own_message(text):
            out.append(Prose(_rel(path), line, text, "a hand-made [entry-id] message"))
        elif ADVICE_RE.search(text):
            out.append(Prose(_rel(path), line, text, "an imperative fix sentence"))
        elif library and LOWER_ADVICE_RE.search(text):
            out.append(Prose(_rel(path), line, text, "a lower-case fix clause"))
        elif len(text) >= 40 and any(text in k for k in known_texts):
            out.append(Prose(_rel(path), line, text, "a copy of a knowledge-base text"))
    return out


#: Entries whose patterns exist for our own messages: tests/test_knowledge.py leaves their
#: real-text check to tests/test_own_errors.py, which feeds them the real messages.
OWN_PATTERNS = {"moe-top-k-range", "ep-size-crosses-nodes", "native-moe-ep-size", "zero3-module-move",
                "zero3-noop-move", "zero3-no-gradient", "zero3-aliased-weight"}
