"""Every private name of torch, DeepSpeed, Lightning and transformers we touch lives in
``lightning_zeromoe/_private/``, and each one still exists in the installed versions.

The list is derived from the code, by AST, not written here:

* an attribute whose name starts with one underscore (read, written or deleted), or a
  ``getattr``/``hasattr``/``setattr`` of such a name, that our own code does not define (a
  function, class, module-level name, or ``self.<name>`` of one of our classes);
* ``from <library> import _name``, and an import or attribute chain through a private module of a
  library (``torch._C``, ``deepspeed.runtime.zero.partition_parameters._x``).

Such an access anywhere outside ``_private/`` fails the first test with its file and line, so an
upgrade that renames a private name breaks in one room, loudly (the second test), instead of
silently changing what a check reports.
"""

from __future__ import annotations

import ast
from pathlib import Path

from lightning_zeromoe import _private

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("lightning_zeromoe", "troubleshooter")
LIBRARIES = ("torch", "deepspeed", "lightning", "transformers", "peft", "safetensors")
#: Private names of Python's standard library we use (not one of the libraries above).
STDLIB = {"_exit": "os._exit: a child process that must not run atexit handlers",
          "_SubParsersAction": "argparse's type of add_subparsers(), for annotations",
          "_asdict": "namedtuple's public API, despite the underscore"}


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def _private_module(path: Path) -> bool:
    return (REPO / "lightning_zeromoe" / "_private") in path.parents


def _defined_by_us(trees: dict[Path, ast.AST]) -> set[str]:
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return names


def _is_private(name: str) -> bool:
    """One leading underscore, and not one of ours: ``_zeromoe*`` marks what we attach to others' objects."""
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_zeromoe")


class _Scan(ast.NodeVisitor):
    """Collects private accesses; an override's ``super().<its own name>(...)`` is subclassing, not one."""

    def __init__(self, ours: set[str]) -> None:
        self.ours = ours
        self.functions: list[str] = []
        self.found: list[tuple[int, str]] = []

    def _library_name(self, name: str) -> bool:
        return _is_private(name) and (name not in self.ours or name in _private.NAMES)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        via_super = (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                     and node.value.func.id == "super")
        if self._library_name(node.attr) and not (via_super and self.functions and self.functions[-1] == node.attr):
            self.found.append((node.lineno, f".{node.attr}"))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and self._library_name(node.args[1].value)):
            self.found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] in LIBRARIES:
            if any(_is_private(part) for part in node.module.split(".")):
                self.found.append((node.lineno, f"from {node.module} import ..."))
            self.found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                           if _is_private(a.name)]

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(node.lineno, f"import {a.name}") for a in node.names
                       if a.name.split(".")[0] in LIBRARIES and any(_is_private(p) for p in a.name.split("."))]


def private_accesses(source: str, ours: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for every access to a library's private name in ``source`` (see the module
    docstring); ``ours`` are the names our own code defines."""
    scan = _Scan(ours)
    scan.visit(ast.parse(source))
    return [(line, what) for line, what in scan.found if what.lstrip(".") not in STDLIB]


def test_private_names_of_libraries_are_touched_only_in_lightning_zeromoe_private():
    trees = {path: ast.parse(path.read_text()) for path in _files()}
    ours = _defined_by_us({p: t for p, t in trees.items() if not _private_module(p)})
    offenders = [f"{path.relative_to(REPO)}:{line}: {what}" for path in trees if not _private_module(path)
                 for line, what in private_accesses(path.read_text(), ours)]
    assert not offenders, "\n".join(offenders)


def test_every_private_name_we_rely_on_exists_in_the_installed_versions():
    assert _private.missing() == []


def test_the_scan_finds_each_form_of_access():
    source = """
import torch._C
from deepspeed.runtime.zero import _private_thing
from lightning.pytorch.strategies.deepspeed import _validate_checkpoint_directory
x = torch._C._nn._parse_to(1)
param._is_hf_initialized = True
flag = getattr(module, "_external_params", None)
self._mine = 1
y = other._mine
os._exit(0)
module._zeromoe_hook = 1
class S(Base):
    def _configure_launcher(self):
        super()._configure_launcher()
        self._config_initialized = False
"""
    found = {what for _, what in private_accesses(source, ours={"_mine", "_config_initialized"})}
    assert found == {"import torch._C", "from deepspeed.runtime.zero import _private_thing",
                     "from lightning.pytorch.strategies.deepspeed import _validate_checkpoint_directory",
                     "._C", "._nn", "._parse_to", "._is_hf_initialized", "getattr(..., '_external_params')",
                     "._config_initialized"}  # a name of the registry is flagged even where we assign it


def test_an_autoep_api_change_is_an_error_naming_the_version(monkeypatch):
    """As an upgrade would: a parameter the probe passes is gone. The probe must not read that as
    "AutoEP refused every block" (then every block trains without expert parallelism)."""
    import deepspeed
    import pytest

    from lightning_zeromoe._private import deepspeed as ds_private

    renamed = tuple((m, q, tuple("source" if p == "source_module" else p for p in params))
                    for m, q, params in ds_private.AUTOEP_API)
    monkeypatch.setattr(ds_private, "AUTOEP_API", renamed + (("deepspeed.module_inject.auto_ep", "Gone", ()),))
    with pytest.raises(RuntimeError, match=rf"^\[stack-versions\] deepspeed {deepspeed.__version__}: AutoEP's API "
                                           r"changed \(.*AutoEPMoELayer no longer takes source.*Gone is gone"):
        ds_private.check_autoep_api()


def test_deepspeed_muon_module_is_imported_without_compiling_and_compiles_on_first_use():
    """``deepspeed.initialize`` imports DeepSpeed's Muon module on every ZeRO engine; imported through
    :func:`import_muon_compiling_on_first_use`, torch's inductor stays unloaded until a kernel runs,
    and the first call goes through ``torch.compile`` (inductor is loaded then) with the same result
    as the undecorated kernel. Dynamo is disabled in the subprocess so that the call runs the
    function eagerly after ``torch.compile`` has wrapped it (compiling it for real on CPU takes a
    minute): what is checked is that compilation is deferred, not what inductor makes of it."""
    import subprocess
    import sys

    code = """
import sys, torch
torch._dynamo.config.disable = True
from lightning_zeromoe._private.deepspeed import MUON_MODULE, import_muon_compiling_on_first_use
import_muon_compiling_on_first_use()
assert MUON_MODULE in sys.modules and 'torch._inductor.compile_fx' not in sys.modules
from deepspeed.runtime.zero.muon import original_muon
kernel = original_muon.zeropower_via_newtonschulz5
G = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
out = kernel(G, 3)
assert 'torch._inductor.compile_fx' in sys.modules, 'the first call did not go through torch.compile'
assert torch.equal(out, kernel.__wrapped__(G, 3))
import_muon_compiling_on_first_use()  # already imported: nothing happens
assert original_muon.zeropower_via_newtonschulz5 is kernel
print('ok')
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
