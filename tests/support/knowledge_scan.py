"""Static scan of the ``troubleshooter`` package for knowledge-base citations and for advice
written outside the knowledge base (used by tests/test_knowledge_citations.py).

A citation is a call of the citation API with the entry (and fix / message) id as arguments:
``knowledge.fix(entry, fix)``, ``knowledge.message(entry, message)``, ``knowledge.get(entry)``
(also through ``from troubleshooter.knowledge import fix``), an ``entry="id"`` keyword, or a
walkthrough step ``Step(title, "entry-id", ("fix-id", ...), ...)`` (``troubleshooter/walkthroughs``):
its fix ids are citations, resolved by ``Step.advice``, the one place allowed to pass ids it
received (``RESOLVERS``).
An id argument may be a literal, ``a if c else b`` of literals, or a lookup in a module-level
dict of literals (``NOTES.get(key, "default")``, ``NOTES[key]``): all its possible values are
checked. Anything else is reported as unresolved (except ``get(variable)``: a lookup of an id
that came from data, such as a finding's rule, not a citation).

Advice prose is a string literal (not a docstring, not argparse help) that holds a sentence
starting with an imperative fix verb ("Set ...", "Delete ...", "Use ..."), a string given as a
``fix=`` / ``why=`` keyword, or a copy of a knowledge-base text.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "troubleshooter"
KNOWLEDGE = PACKAGE / "knowledge"

_VERBS = ("Set|Use|Remove|Delete|Rename|Install|Lower|Raise|Choose|Pick|Move|Add|Make|Upgrade|"
          "Downgrade|Pin|Reinstall|Enable|Disable|Replace|Export|Increase|Reduce|Pass|Try|"
          "Unset|Give|Keep|Apply|Prefer|Avoid|Consider|Mount|Point|Build|Pre-build|Wrap|Switch|"
          "Drop|Free|Restart|Rebuild|Clear|Lint")
#: A sentence that starts with a fix verb and goes on for at least two more words.
ADVICE_RE = re.compile(r"(?:^|[.;:!?]\s+|\(\s*|\n\s*)(?:Or |Then |Instead, )?(?:" + _VERBS
                       + r")\s+[\w'\"`{(./-]\S*")
#: Keywords whose string value is documentation of the interface, not advice about a problem.
DOC_KEYWORDS = {"help", "description", "epilog", "metavar", "usage", "prog", "title"}
#: Positional arguments that are UI labels (a step's title and check-button label, a button's
#: caption, a walkthrough's title), not advice: short names of what a step does.
LABEL_ARGS = {"Step": (0, 3), "Walkthrough": (1,), "_button": (0,)}
#: Keywords whose string value is advice by definition (it must be a citation instead).
ADVICE_KEYWORDS = {"fix", "fixes", "why", "advice", "hint"}


#: (file, function) pairs that resolve ids checked elsewhere: ``Step.advice`` looks up the fix ids
#: every ``Step(...)`` construction cites, and those constructions are scanned as citations.
RESOLVERS = {("troubleshooter/walkthroughs/base.py", "advice")}


@dataclass(frozen=True)
class Citation:
    path: str
    line: int
    kind: str  # "fix" | "message" | "entry"
    entries: tuple[str, ...]  # possible entry ids ( () when unresolved )
    ids: tuple[str, ...]  # possible fix/message ids (empty for "entry")
    unresolved: bool = False


@dataclass(frozen=True)
class Prose:
    path: str
    line: int
    text: str
    why: str


def _module_dicts(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            values = node.value.values
            if values and all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values):
                for t in targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = tuple(v.value for v in values)
    return out


def _values(node: ast.AST, dicts: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    """Every string the expression can be, or None when that is not known statically."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, ast.Tuple):
        parts = [_values(e, dicts) for e in node.elts]
        return None if any(p is None for p in parts) else tuple(v for p in parts for v in p)
    if isinstance(node, ast.IfExp):
        a, b = _values(node.body, dicts), _values(node.orelse, dicts)
        return None if a is None or b is None else a + b
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in dicts:
        return dicts[node.value.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in dicts):
        default = _values(node.args[1], dicts) if len(node.args) > 1 else ()
        return None if default is None else dicts[node.func.value.id] + default
    return None


def _aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to the knowledge module, and names bound to its functions (alias -> name)."""
    modules: set[str] = set()
    funcs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "troubleshooter":
            modules |= {a.asname or a.name for a in node.names if a.name == "knowledge"}
        elif isinstance(node, ast.ImportFrom) and node.module == "troubleshooter.knowledge":
            funcs.update({a.asname or a.name: a.name for a in node.names if a.name in ("fix", "message", "get")})
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "troubleshooter.knowledge" and a.asname}
    return modules, funcs


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def python_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if KNOWLEDGE not in p.parents)


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(PACKAGE.parent).as_posix()
    except ValueError:  # a file outside the package (the scanner's own tests)
        return path.as_posix()


def citations(path: Path) -> list[Citation]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, funcs = _aliases(tree)
    dicts = _module_dicts(tree)
    out: list[Citation] = []
    resolver_calls = {id(sub) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                      and (_rel(path), fn.name) in RESOLVERS for sub in ast.walk(fn)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == "Step" and len(node.args) >= 3:
            entries, ids = _values(node.args[1], dicts), _values(node.args[2], dicts)
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
        if name not in ("fix", "message", "get") or not node.args:
            continue
        entries = _values(node.args[0], dicts)
        ids = _values(node.args[1], dicts) if name != "get" and len(node.args) > 1 else ()
        unresolved = entries is None or ids is None
        if unresolved and id(node) in resolver_calls:
            continue
        if name == "get" and unresolved:
            continue  # get(variable) looks up an id that came from data (a finding's rule)
        out.append(Citation(_rel(path), node.lineno, "entry" if name == "get" else name,
                            entries or (), ids or (), unresolved))
    return out


def _string_nodes(tree: ast.Module):
    """(node, text, keyword) for every string literal and f-string, with the keyword it is
    passed as (or None)."""
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


def prose(path: Path, known_texts: list[str]) -> list[Prose]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    out: list[Prose] = []
    for node, text, keyword in _string_nodes(tree):
        if id(node) in docs or keyword in DOC_KEYWORDS:
            continue
        line = getattr(node, "lineno", 0)
        if keyword in ADVICE_KEYWORDS and len(text.split()) >= 3:
            out.append(Prose(_rel(path), line, text, f"a hand-written {keyword}= string"))
        elif ADVICE_RE.search(text):
            out.append(Prose(_rel(path), line, text, "an imperative fix sentence"))
        elif len(text) >= 40 and any(text in k for k in known_texts):
            out.append(Prose(_rel(path), line, text, "a copy of a knowledge-base text"))
    return out


#: Entries whose patterns exist for our own messages: tests/test_knowledge.py leaves their
#: real-text check to tests/test_own_errors.py, which feeds them the real messages.
OWN_PATTERNS = {"moe-top-k-range", "ep-size-crosses-nodes", "native-moe-ep-size", "zero3-module-move",
                "zero3-noop-move", "zero3-no-gradient", "zero3-aliased-weight"}
