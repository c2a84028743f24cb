"""Build-related environment: ``DS_BUILD_*`` and leftover lock files in the extensions cache.

Why ``DS_BUILD_*``: the seeds say ``DS_BUILD_OPS=0`` "skips compilation". It does not. DeepSpeed's
setup.py reads ``DS_BUILD_OPS`` (default 0 on Linux) and ``DS_BUILD_<OP>`` (default: the value of
``DS_BUILD_OPS``) only while ``pip install`` builds deepspeed: 1 pre-compiles the op into the
install, 0 or unset leaves it to be JIT-compiled at first use. At run time nothing reads them. A
``DS_BUILD_<OP>`` that names no op is silently ignored. The op names are read from the installed
builders' ``BUILD_VAR`` (deepspeed/ops/op_builder/**.py), the pre-built ops from
deepspeed/git_version_info_installed.py, both parsed, not imported.

Why locks: torch.utils.cpp_extension guards each JIT build with ``<build dir>/lock``
(``FileBaton``: created with O_EXCL, removed when the build ends). A build killed midway leaves the
file, and every later build of that op waits on it forever: the classic "DeepSpeed hangs at
'Loading extension module'". The build dir is ``$TORCH_EXTENSIONS_DIR/<op>``, or by default
``<XDG_CACHE_HOME or ~/.cache>/torch_extensions/py<ver>_<cpu|cuXYZ>/<op>``
(torch/utils/cpp_extension.py ``_get_build_directory``).
"""

from __future__ import annotations

import ast
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

from lightning_zeromoe import compat
from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite, process_ids
from troubleshooter.doctor.probes import ProbeSet
from troubleshooter.doctor.versions import package_dir

#: Read by deepspeed's setup.py besides the per-op BUILD_VARs (checked against its setup.py).
SETUP_NAMES = {"DS_BUILD_OPS": "default for every op (1 pre-builds, 0/unset leaves to JIT)",
               "DS_BUILD_STRING": "a suffix for the version string of the built package"}
BUILD_VAR = re.compile(r"""BUILD_VAR\s*=\s*["'](DS_BUILD_[A-Z0-9_]+)["']""")


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """DS_BUILD_* meaning, misspelt knobs, and stale JIT lock files."""
    return [ds_build_result(options.env), knob_names_result(options.env), locks_result(options)]


def knob_names_result(env: Mapping[str, str]) -> CheckResult:
    """Did-you-mean for DS_BUILD_*, NCCL_*, TORCH_* and PYTORCH_* variables no library reads."""
    from troubleshooter.doctor import knobs
    from troubleshooter.doctor.timeouts import TORCH_NCCL_KNOBS

    title = "Environment knob names"
    candidates = {k: v for k, v in env.items() if k.startswith(knobs.PREFIXES)}
    if not candidates:
        return CheckResult("env.knob_names", title, "ok", "no DS_BUILD_*, NCCL_*, TORCH_* or PYTORCH_* set")
    known = knobs.known_names(known_build_vars(), set(SETUP_NAMES), set(TORCH_NCCL_KNOBS))
    found = knobs.typos(candidates, known)
    details = {"set": sorted(candidates), "typos": [vars(t) for t in found]}
    if not found:
        return CheckResult("env.knob_names", title, "ok",
                           f"{len(candidates)} set, none a near miss of a known name", details=details)
    rename = knowledge.fix("env-knob-typo", "rename-knob")
    return CheckResult(
        "env.knob_names", title, "warn",
        "; ".join(knowledge.message("env-knob-typo", "unknown-name").render(
            name=t.name, reader=t.reader, suggestion=t.suggestion) for t in found),
        why=knowledge.get("env-knob-typo").cause.split("\n\n")[0].replace("\n", " "),
        entry="env-knob-typo",
        fix=" ".join(rename.render(name=t.name, suggestion=t.suggestion, reader=t.reader) for t in found),
        fix_id="env-knob-typo/rename-knob", details=details)


def known_build_vars() -> set[str]:
    """Every DS_BUILD_<OP> name the installed deepspeed's op builders declare."""
    root = package_dir("deepspeed")
    names: set[str] = set()
    if root is None:
        return names
    for path in (root / "ops" / "op_builder").rglob("*.py"):
        names.update(BUILD_VAR.findall(path.read_text(errors="replace")))
    return names


def prebuilt_ops() -> list[str] | None:
    """Ops compiled into the installed deepspeed (git_version_info_installed.installed_ops)."""
    root = package_dir("deepspeed")
    path = root / "git_version_info_installed.py" if root else None
    if path is None or not path.is_file():
        return None
    for node in ast.parse(path.read_text(errors="replace")).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "installed_ops":
            try:
                return sorted(k for k, v in ast.literal_eval(node.value).items() if v)
            except ValueError:
                return None
    return None


def ds_build_result(env: Mapping[str, str]) -> CheckResult:
    """What the DS_BUILD_* variables that are set really do."""
    title = "DS_BUILD_OPS / DS_BUILD_*"
    set_vars = {k: v for k, v in env.items() if k.startswith("DS_BUILD_")}
    known = known_build_vars()
    prebuilt = prebuilt_ops()
    details = {"set": set_vars, "known_op_vars": sorted(known), "prebuilt_ops": prebuilt}
    meaning = compat.ENV_FACTS["DS_BUILD_OPS"]
    if not set_vars:
        return CheckResult("env.ds_build", title, "ok",
                           "none set: ops are JIT-compiled at first use (the Linux default); "
                           f"pre-built in this install: {', '.join(prebuilt or []) or 'none'}",
                           why=meaning, entry="ds-build-ops-meaning", details=details)
    problems = []
    unknown = sorted(k for k in set_vars if k not in known and k not in SETUP_NAMES)
    if unknown:
        problems.append(f"{', '.join(unknown)}: not a DS_BUILD name this deepspeed knows; ignored")
    ops_value = set_vars.get("DS_BUILD_OPS", "")
    if ops_value and not ops_value.strip().lstrip("-").isdigit():
        problems.append(f"DS_BUILD_OPS={ops_value!r} is not an integer: deepspeed's setup.py "
                        "fails on int()")
    elif ops_value.strip() == "0":
        problems.append("DS_BUILD_OPS=0 does not skip compilation: it pre-builds nothing, so every "
                        "op is still JIT-compiled at first use")
    elif ops_value.strip() == "1" and not prebuilt:
        problems.append("DS_BUILD_OPS=1 is set, but the installed deepspeed has no pre-built op: it "
                        "acts only while pip builds deepspeed, not at run time")
    found = ", ".join(f"{k}={v}" for k, v in sorted(set_vars.items()))
    if problems:
        return CheckResult("env.ds_build", title, "warn", f"{found}: " + "; ".join(problems),
                           why=meaning, entry="ds-build-ops-meaning",
                           **cite(knowledge.fix("ds-build-ops-meaning", "unset-at-run-time"),
                                  names=" ".join(sorted(set_vars))),
                           details=details)
    return CheckResult("env.ds_build", title, "ok",
                       f"{found}: read only when pip builds deepspeed; pre-built in this install: "
                       f"{', '.join(prebuilt or []) or 'none'}",
                       why=meaning, entry="ds-build-ops-meaning", details=details)


def extensions_roots(env: Mapping[str, str]) -> tuple[Path, str]:
    """The extensions root torch uses, and where that came from."""
    if env.get("TORCH_EXTENSIONS_DIR") is not None:
        return Path(env["TORCH_EXTENSIONS_DIR"]), "$TORCH_EXTENSIONS_DIR"
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"),
                                                      ".cache")
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions"))), "default cache"


def find_locks(root: Path) -> list[Path]:
    """``<root>/<op>/lock`` (TORCH_EXTENSIONS_DIR) and ``<root>/<pyXY_acc>/<op>/lock`` (default)."""
    if not root.is_dir():
        return []
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def age_minutes(path: Path) -> float | None:
    """Minutes since the lock was written; None if it vanished meanwhile (a build finished)."""
    try:
        return round((time.time() - path.stat().st_mtime) / 60, 1)
    except FileNotFoundError:
        return None


def holders(paths: list[Path]) -> dict[str, list[int]]:
    """Which processes hold each lock open (FileBaton keeps its descriptor for the whole build)."""
    wanted = {os.path.realpath(p): str(p) for p in paths}
    found: dict[str, list[int]] = {str(p): [] for p in paths}
    for pid in process_ids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in wanted:
                found[wanted[target]].append(int(pid))
    return found


def locks_result(options: DoctorOptions) -> CheckResult:
    """Lock files older than the limit that no live process holds are stale."""
    title = "Stale JIT build locks"
    root, source = extensions_roots(options.env)
    ages = {p: age for p in find_locks(root) if (age := age_minutes(p)) is not None}
    held = holders(list(ages)) if ages else {}
    rows = [{"path": str(p), "age_min": age, "held_by": held.get(str(p), [])}
            for p, age in ages.items()]
    stale = [r for r in rows if not r["held_by"] and r["age_min"] >= options.stale_lock_minutes]
    details = {"root": str(root), "root_from": source, "locks": rows,
               "stale_after_min": options.stale_lock_minutes}
    if stale:
        listing = ", ".join(f"{r['path']} ({r['age_min']:g} min old)" for r in stale)
        return CheckResult(
            "env.extension_locks", title, "fail",
            f"{len(stale)} stale lock(s), held by no process: {listing}",
            why=knowledge.message("stale-extension-lock", "waits-forever").render(),
            entry="stale-extension-lock",
            **cite(knowledge.fix("stale-extension-lock", "delete-these-locks"),
                   paths=" ".join(r["path"] for r in stale)), details=details)
    if rows:
        note = "; ".join(f"{r['path']}: " + (f"held by pid {r['held_by']}" if r["held_by"]
                                               else f"{r['age_min']:g} min old, not yet stale")
                         for r in rows)
        return CheckResult("env.extension_locks", title, "ok", f"build in progress or recent: {note}",
                           details=details)
    return CheckResult("env.extension_locks", title, "ok",
                       f"no lock files under {root} ({source})", details=details)
