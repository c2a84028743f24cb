"""Build tools for DeepSpeed's just-in-time ops, and the op table ``ds_report`` prints.

Why: DeepSpeed wheels from PyPI ship no compiled ops; each op (cpu_adam, fused_adam, the CPU
shared-memory comm op, ...) is compiled by torch.utils.cpp_extension the first time it is used.
That needs a C++ compiler (``$CXX``, else ``c++``: torch's ``get_cxx_compiler``) and ``ninja``
on PATH (torch's ``is_ninja_available`` runs ``ninja --version``). A missing one shows up only
mid-training, as "Unable to JIT load the ... op".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite, error_result, run_probe
from troubleshooter.doctor.probes import ProbeSet

#: Ops this project's training paths load: optimizer (GPU and offload) and CPU collectives.
IMPORTANT_OPS = ("fused_adam", "cpu_adam", "deepspeed_shm_comm")


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """Compiler, ninja, and the op table."""
    return [compiler_result(options), ninja_result(options), ops_result(options, probes)]


def tool_version(name: str, env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Where ``name`` is on PATH and the first line of ``name --version`` (time-limited)."""
    path = shutil.which(name, path=env.get("PATH", os.defpath))
    info: dict[str, Any] = {"name": name, "path": path, "version": None}
    if path is None:
        return info
    outcome = run_probe([path, "--version"], timeout, env=env)
    if outcome.ok:
        info["version"] = (outcome.stdout.strip().splitlines() or [""])[0]
    elif outcome.timed_out or outcome.launch_error:
        info["probe_error"] = outcome.describe_failure(timeout)
    else:
        info["problem"] = outcome.describe_failure(timeout)
    return info


def compiler_result(options: DoctorOptions) -> CheckResult:
    """The compiler torch will call for JIT builds, plus gcc/g++ for the record."""
    cxx = options.env.get("CXX") or "c++"
    main = tool_version(cxx, options.env, options.timeout)
    others = {n: shutil.which(n, path=options.env.get("PATH", os.defpath)) for n in ("gcc", "g++")}
    details = {"cxx": main, "which": others, "source": "$CXX" if options.env.get("CXX") else "default c++"}
    title = "C++ compiler"
    if "probe_error" in main:
        return error_result("build.compiler", title, main["probe_error"], details=details,
                            timeout=options.timeout)
    if main["path"] is None or main["version"] is None:
        return CheckResult(
            "build.compiler", title, "fail",
            f"{cxx} ({details['source']}) not usable: {main.get('problem', 'not on PATH')}",
            why=knowledge.message("missing-compiler", "compiler-needed").render(cxx=cxx),
            entry="missing-compiler", **cite(knowledge.fix("missing-compiler", "set-cxx"), cxx=cxx,
                                             problem=main.get("problem", "not on PATH")),
            details=details)
    return CheckResult("build.compiler", title, "ok", f"{cxx}: {main['version']} ({main['path']})",
                       details=details)


def ninja_result(options: DoctorOptions) -> CheckResult:
    """ninja on PATH, as torch checks it."""
    info = tool_version("ninja", options.env, options.timeout)
    title = "ninja"
    if "probe_error" in info:
        return error_result("build.ninja", title, info["probe_error"], details=info,
                            timeout=options.timeout)
    if info["version"] is None:
        return CheckResult(
            "build.ninja", title, "fail", f"ninja not usable: {info.get('problem', 'not on PATH')}",
            why=knowledge.message("ninja-missing", "ninja-needed").render(),
            entry="ninja-missing", **cite(knowledge.fix("ninja-missing", "install-ninja")), details=info)
    return CheckResult("build.ninja", title, "ok", f"ninja {info['version']} ({info['path']})",
                       details=info)


def ops_result(options: DoctorOptions, probes: ProbeSet) -> CheckResult:
    """The ds_report op table: pre-built ops and ops this machine can JIT-compile."""
    title = "DeepSpeed ops (ds_report)"
    table, outcome = probes.stage("ops")
    if table is None or "exception" in table:
        reason = table["exception"] if table else outcome.describe_failure(options.timeout)
        return error_result("build.ops", title, f"deepspeed op probe: {reason}",
                            why=knowledge.message("doctor-run", "probe-died").render(what="op table"),
                            details={"stderr_tail": outcome.stderr[-2000:]}, timeout=options.timeout)
    ops = table["ops"]
    compatible = sorted(n for n, o in ops.items() if o["compatible"])
    installed = sorted(n for n, o in ops.items() if o["installed"])
    missing = [n for n in IMPORTANT_OPS if n in ops and not ops[n]["compatible"]]
    found = (f"accelerator {table['accelerator']}; {len(compatible)}/{len(ops)} ops can be JIT-built; "
             f"pre-built: {', '.join(installed) or 'none'}")
    incompatible = sorted(set(ops) - set(compatible))
    if incompatible:  # with the builders' own reasons, as ds_report prints them
        found += "; not compatible: " + ", ".join(
            f"{n} ({ops[n]['reason']})" if ops[n].get("reason") else n for n in incompatible)
    details = {**table, "compatible": compatible, "installed": installed}
    if missing:
        reasons = "; ".join(f"{n}: {ops[n]['reason'] or 'not compatible'}" for n in missing)
        return CheckResult(
            "build.ops", title, "warn", found,
            why=knowledge.message("extension-build-error", "ops-not-buildable").render(reasons=reasons),
            entry="extension-build-error", **cite(knowledge.fix("extension-build-error", "run-ds-report")),
            details=details)
    return CheckResult("build.ops", title, "ok", found,
                       why=knowledge.message("extension-build-error", "ops-jit").render(), details=details)
