"""Every module imports where Unix-only pieces are missing, as on Windows (issue 16 item 6).

A fresh interpreter first takes away what Windows lacks: the ``fcntl`` module
(``sys.modules["fcntl"] = None`` makes ``import fcntl`` raise ``ImportError``), the ``resource``
module for this project's own imports, and ``ctypes.CDLL(None)`` (the process's own C library;
Windows raises ``TypeError``). Then it imports every module of
``lightning_zeromoe`` and ``troubleshooter`` found by ``pkgutil.walk_packages`` and calls
``lightning_zeromoe.loading.memory_release``'s entry points, which must do nothing. ``sys.platform`` is
set to ``"win32"`` only for those calls, after the imports: torch and other libraries read it
while importing to decide how to load their DLLs, which is not what this test is about.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lightning_zeromoe", "troubleshooter")
#: Standard-library modules that Windows does not have, refused to every importer.
MISSING_EVERYWHERE = ("fcntl",)
#: Refused only to this project's modules: psutil (which DeepSpeed imports) chooses its Linux
#: backend, which imports ``resource``, from ``sys.platform``; on Windows it chooses another.
MISSING_FOR_OUR_CODE = ("resource",)
#: Not imported: importing a package's ``__main__`` runs its program (``troubleshooter/__main__.py``
#: calls ``sys.exit(main())``).
NOT_IMPORTED = ("__main__",)
#: Modules that fail in this setting today, with why; strict, so a fix shows up as XPASS (then
#: delete the entry).
KNOWN_FAILURES = {
    "troubleshooter.repro._oom_child": "Linux-only child process by design (RLIMIT_AS from the resource module, "
                                       "/proc/self/status)",
}

_CHILD = r"""
import builtins, json, sys
for name in MISSING_EVERYWHERE:
    sys.modules[name] = None  # import raises ImportError, as where the module does not exist

_real_import = builtins.__import__

def _import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if level == 0 and name.partition(".")[0] in MISSING_FOR_OUR_CODE and importer.partition(".")[0] in PACKAGES:
        raise ModuleNotFoundError(f"No module named {name!r} (refused: as on Windows)", name=name)
    return _real_import(name, globals, locals, fromlist, level)

builtins.__import__ = _import

import ctypes

class _CDLL(ctypes.CDLL):
    def __init__(self, name, *args, **kwargs):
        if name is None:  # what Windows does with CDLL(None)
            raise TypeError("LoadLibrary() argument 1 must be str, not None")
        super().__init__(name, *args, **kwargs)

ctypes.CDLL = _CDLL

import faulthandler, importlib, pkgutil

def error_text(err):
    return f"{type(err).__name__}: {err}"

imports = {}
for package in PACKAGES:
    try:
        root = importlib.import_module(package)
    except BaseException as err:
        imports[package] = error_text(err)
        continue
    imports[package] = None
    for info in pkgutil.walk_packages(root.__path__, package + ".", onerror=lambda name: None):
        if info.name.rsplit(".", 1)[-1] in NOT_IMPORTED:
            continue
        try:
            importlib.import_module(info.name)
            imports[info.name] = None
        except BaseException as err:
            imports[info.name] = error_text(err)
        faulthandler.cancel_dump_traceback_later()  # a child script arms a watchdog when imported

def entry_points():
    import torch
    from lightning_zeromoe.loading import memory_release

    out = {"can_release_pages": memory_release.can_release_pages()}
    tensor = torch.ones(1 << 18)
    pages = memory_release.FilePages()
    out["mappings"] = len(pages.mappings)
    out["release"] = pages.release(tensor)
    out["release_mappings"] = pages.release_mappings([tensor])
    out["trim_heap"] = memory_release.trim_heap()
    partitioned = torch.nn.Linear(1, 1)
    partitioned.weight.ds_tensor, partitioned.weight.ds_numel = torch.empty(0), 1 << 20
    parent = torch.nn.Module()
    with memory_release.trim_after_each_partition():
        parent.child = partitioned  # calls trim_heap
    out["unchanged"] = bool(torch.equal(tensor, torch.ones(1 << 18)))
    return out

calls = {}
try:
    ctypes.CDLL(None)
    calls["CDLL(None)"] = "did not raise: the test's setup is broken"
except TypeError:
    calls["CDLL(None)"] = "raises TypeError"
real_platform = sys.platform
for platform in (real_platform, "win32"):
    sys.platform = platform
    try:
        calls[platform] = entry_points()
    except BaseException as err:
        calls[platform] = error_text(err)
    finally:
        sys.platform = real_platform
print(json.dumps({"imports": imports, "calls": calls, "platform": real_platform}))
"""


def module_names(directory: Path, package: str) -> list[str]:
    """``package`` and every module and subpackage under its ``directory``, found on disk (nothing
    is imported), less :data:`NOT_IMPORTED`."""
    names = [package]
    for info in pkgutil.iter_modules([str(directory)]):
        if info.name in NOT_IMPORTED:
            continue
        name = f"{package}.{info.name}"
        names += module_names(directory / info.name, name) if info.ispkg else [name]
    return names


ALL_MODULES = [name for package in PACKAGES for name in module_names(ROOT / package, package)]


@pytest.fixture(scope="module")
def windows_like() -> dict:
    """The child's report: ``imports`` (module: error or None), ``calls`` (per platform)."""
    code = "".join(f"{name} = {value!r}\n" for name, value in [
        ("MISSING_EVERYWHERE", MISSING_EVERYWHERE), ("MISSING_FOR_OUR_CODE", MISSING_FOR_OUR_CODE),
        ("PACKAGES", PACKAGES), ("NOT_IMPORTED", NOT_IMPORTED)]) + _CHILD
    # _pitfalls_child reads the RANK its parent gives it when imported.
    env = {**os.environ, "RANK": "0", "REPRO_RANK_TIMEOUT": "3600"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def import_error(imports: dict[str, str | None], module: str) -> str | None:
    """Why ``module`` did not import in the child, or ``None`` when it did. A module that
    ``pkgutil.walk_packages`` never reached is blamed on the innermost of its packages that failed."""
    if module in imports:
        return imports[module]
    parts = module.split(".")
    for i in range(len(parts) - 1, 0, -1):
        package = ".".join(parts[:i])
        if imports.get(package):
            return f"not reached: package {package} failed ({imports[package]})"
    return "not reached by pkgutil.walk_packages"


def test_import_error_blames_the_failing_package():
    imports = {"p": None, "p.q": "ImportError: x", "p.r": None}
    assert import_error(imports, "p.r") is None
    assert import_error(imports, "p.q.s") == "not reached: package p.q failed (ImportError: x)"
    assert import_error(imports, "p.t") == "not reached by pkgutil.walk_packages"


def test_the_walk_finds_every_module_on_disk(windows_like):
    """Every module on disk was reached by pkgutil.walk_packages, or sits in a package that failed
    (which the walk cannot look into; that package's own test fails)."""
    assert len(ALL_MODULES) > 50 and "lightning_zeromoe.loading.memory_release" in ALL_MODULES
    imports = windows_like["imports"]
    unreached = [m for m in ALL_MODULES if m not in imports and not import_error(imports, m).startswith("not reached: ")]
    assert unreached == []
    assert sorted(set(imports) - set(ALL_MODULES)) == []  # the disk scan missed nothing either


@pytest.mark.parametrize("module", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name]))
    if name in KNOWN_FAILURES else name for name in ALL_MODULES])
def test_module_imports_without_unix_only_pieces(windows_like, module):
    error = import_error(windows_like["imports"], module)
    assert error is None, f"{module}: {error}"


def test_memory_release_is_a_no_op_without_a_c_library(windows_like):
    """With ``CDLL(None)`` failing, and then with ``sys.platform`` as on Windows as well, nothing is
    released or trimmed, and nothing raises."""
    calls = windows_like["calls"]
    assert calls["CDLL(None)"] == "raises TypeError"
    no_op = {"can_release_pages": False, "mappings": 0, "release": None, "release_mappings": 0,
             "trim_heap": None, "unchanged": True}
    assert calls[windows_like["platform"]] == no_op
    assert calls["win32"] == no_op


def test_known_failures_name_real_modules():
    """An entry for a renamed or deleted module would never be checked again."""
    assert set(KNOWN_FAILURES) <= set(ALL_MODULES)
