"""torch's CUDA against the system CUDA toolkit, and the GPUs torch can see.

Why: DeepSpeed JIT-compiles its CUDA ops (FusedAdam, ...) with the toolkit's ``nvcc``, and its op
builder refuses a toolkit whose version differs from the one torch was built with
(deepspeed/ops/op_builder/builder.py ``assert_no_cuda_mismatch``). The rule copied here, from
that file in deepspeed 0.19.8:

* CUDA_HOME is torch's ``torch.utils.cpp_extension.CUDA_HOME``: ``$CUDA_HOME``, else ``$CUDA_PATH``,
  else two levels above ``nvcc`` on PATH, else ``/usr/local/cuda`` if it exists
  (torch/utils/cpp_extension.py ``_find_cuda_home``); DeepSpeed runs ``$CUDA_HOME/bin/nvcc -V``.
* Same major.minor: accepted. Different, but both versions listed for that major in the builder's
  ``cuda_minor_mismatch_ok`` table (11.0-11.8, 12.0-12.9 without 12.7, ...): accepted with a
  printed note. Anything else, including every mismatch within CUDA 13 and every major mismatch:
  ``CUDAMismatchException``, unless ``DS_SKIP_CUDA_CHECK=1``.

The table is read from the installed builder.py (parsed, not imported), so a newer deepspeed's
tolerance is honoured. torch's own CUDA version and the GPU facts come from the torch probe,
which runs in a subprocess with a time limit because initialising CUDA can hang.
"""

from __future__ import annotations

import ast
import os
import shutil
from collections.abc import Mapping
from typing import Any

from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite, error_result, run_probe
from troubleshooter.doctor.probes import ProbeSet
from troubleshooter.doctor.versions import package_dir

CPU_MODE = knowledge.message("cuda-home-missing", "cpu-mode").text


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """Toolkit, torch-vs-toolkit match, GPUs."""
    toolkit = {**find_toolkit(options.env, options.timeout), "timeout": options.timeout}
    stage, outcome = probes.stage("cuda")
    if stage is None or "exception" in stage:
        reason = stage["exception"] if stage else outcome.describe_failure(options.timeout)
        failed = error_result("cuda.torch", "torch CUDA probe", f"torch probe: {reason}",
                              why=knowledge.message("doctor-run", "probe-died").render(
                                  what="torch CUDA version and GPU list"), timeout=options.timeout,
                              details={"stderr_tail": outcome.stderr[-2000:]})
        return [toolkit_result(toolkit, torch_cuda=None, torch_known=False), failed]
    torch_cuda = stage.get("torch_cuda")
    return [toolkit_result(toolkit, torch_cuda, torch_known=True),
            match_result(toolkit, stage, options.env),
            gpus_result(stage, options.env.get("CUDA_VISIBLE_DEVICES"))]


def find_cuda_home(env: Mapping[str, str]) -> tuple[str | None, str]:
    """torch's CUDA_HOME rule (``_find_cuda_home``), and how the home was found."""
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(name):
            return env[name], f"${name}"
    nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc)), f"nvcc on PATH ({nvcc})"
    if os.path.exists("/usr/local/cuda"):
        return "/usr/local/cuda", "default /usr/local/cuda"
    return None, "no $CUDA_HOME, $CUDA_PATH, nvcc on PATH or /usr/local/cuda"


def parse_release(text: str) -> tuple[int, int] | None:
    """``... release 12.4, V12.4.131`` -> (12, 4), parsed the way DeepSpeed parses it."""
    words = text.split()
    if "release" not in words or words.index("release") + 1 >= len(words):
        return None
    parts = words[words.index("release") + 1].replace(",", "").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def find_toolkit(env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """CUDA_HOME, its nvcc and nvcc's release (run with a time limit)."""
    home, how = find_cuda_home(env)
    info: dict[str, Any] = {"cuda_home": home, "found_via": how, "nvcc": None, "release": None}
    if home is None:
        return info
    nvcc = os.path.join(home, "bin", "nvcc")
    info["nvcc"] = nvcc
    if not os.path.exists(nvcc):
        info["problem"] = f"{nvcc} does not exist"
        return info
    outcome = run_probe([nvcc, "-V"], timeout, env=env)
    if outcome.timed_out or outcome.launch_error:
        info["probe_error"] = outcome.describe_failure(timeout)
    elif not outcome.ok:
        info["problem"] = outcome.describe_failure(timeout)
    else:
        info["release"] = parse_release(outcome.stdout)
        if info["release"] is None:
            info["problem"] = f"no 'release X.Y' in the output of {nvcc} -V"
    return info


def toolkit_result(toolkit: dict[str, Any], torch_cuda: str | None, torch_known: bool) -> CheckResult:
    """Is there an nvcc DeepSpeed can use? Matters only for a CUDA build of torch."""
    title = "CUDA toolkit (nvcc)"
    if "probe_error" in toolkit:
        return error_result("cuda.toolkit", title, toolkit["probe_error"], details=toolkit,
                            why=knowledge.message("cuda-home-missing", "nvcc-hangs").render(),
                            timeout=toolkit.get("timeout", 60.0))
    release = toolkit.get("release")
    if release is not None:
        return CheckResult("cuda.toolkit", title, "ok",
                           f"nvcc {release[0]}.{release[1]} at {toolkit['nvcc']} "
                           f"(CUDA_HOME={toolkit['cuda_home']}, from {toolkit['found_via']})",
                           details=toolkit)
    missing = toolkit.get("problem") or toolkit["found_via"]
    if torch_known and torch_cuda is None:
        return CheckResult("cuda.toolkit", title, "skip", f"no usable nvcc: {missing}",
                           why=knowledge.message("cuda-home-missing", "cpu-build").render(),
                           details=toolkit)
    return CheckResult(
        "cuda.toolkit", title, "warn", f"no usable nvcc: {missing}",
        why=knowledge.message("cuda-home-missing", "no-nvcc").render(torch_cuda=torch_cuda or "?"),
        entry="cuda-home-missing",
        **cite(knowledge.fix("cuda-home-missing", "toolkit-for-torch"), torch_cuda=torch_cuda or "?"),
        details=toolkit)


def minor_tolerance() -> dict[int, list[str]] | None:
    """``cuda_minor_mismatch_ok`` from the installed deepspeed's builder.py, parsed, not imported."""
    root = package_dir("deepspeed")
    path = root / "ops" / "op_builder" / "builder.py" if root else None
    if path is None or not path.is_file():
        return None
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "cuda_minor_mismatch_ok"):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def compare(torch_cuda: str, system: tuple[int, int], tolerance: dict[int, list[str]] | None,
            skip_check: bool) -> tuple[str, str]:
    """(status, reason) for torch's CUDA against the toolkit, by DeepSpeed's rule."""
    torch_mm = ".".join(torch_cuda.split(".")[:2])
    sys_mm = f"{system[0]}.{system[1]}"
    if torch_mm == sys_mm:
        return "ok", "same major.minor: DeepSpeed builds its CUDA ops with this toolkit"
    same_major = torch_mm.split(".")[0] == str(system[0])
    allowed = (tolerance or {}).get(system[0], [])
    if same_major and sys_mm in allowed and torch_mm in allowed:
        return "warn", (f"minor mismatch that DeepSpeed accepts: {sys_mm} and {torch_mm} are both in "
                        f"its cuda_minor_mismatch_ok table for CUDA {system[0]}")
    kind = "minor" if same_major else "major"
    if skip_check:
        extra = ("; pre-building at install (DS_BUILD_OPS=1) still fails: torch's BuildExtension "
                 "refuses a major mismatch (cpp_extension.py _check_cuda_version)") if kind == "major" else ""
        return "warn", (f"{kind} mismatch, let through only because DS_SKIP_CUDA_CHECK=1; the "
                        f"compiled ops may misbehave{extra}")
    if same_major and tolerance is None:
        return "warn", "minor mismatch; the installed deepspeed's tolerance table could not be read"
    return "fail", (f"{kind} mismatch: DeepSpeed's op builder raises CUDAMismatchException "
                    f"('Installed CUDA version {sys_mm} does not match the version torch was "
                    f"compiled with {torch_cuda}')")


def match_result(toolkit: dict[str, Any], stage: dict[str, Any], env: Mapping[str, str]) -> CheckResult:
    """torch.version.cuda against nvcc's release."""
    title = "torch CUDA vs system CUDA"
    torch_cuda, release = stage.get("torch_cuda"), toolkit.get("release")
    details = {"torch_cuda": torch_cuda, "system_cuda": release, "hip": stage.get("hip")}
    if stage.get("hip"):
        return CheckResult("cuda.match", title, "skip", f"torch is a ROCm build (HIP {stage['hip']})",
                           why=knowledge.message("cuda-home-missing", "rocm").render(), details=details)
    if torch_cuda is None:
        return CheckResult("cuda.match", title, "skip", "torch is a CPU build (torch.version.cuda is None)",
                           why=CPU_MODE, details=details)
    if release is None:
        return CheckResult("cuda.match", title, "skip",
                           f"torch built with CUDA {torch_cuda}; no nvcc to compare with",
                           why=knowledge.message("cuda-home-missing", "see-toolkit").render(),
                           details=details)
    tolerance = minor_tolerance()
    details["tolerance_table"] = {str(k): v for k, v in (tolerance or {}).items()}
    status, reason = compare(torch_cuda, release, tolerance, env.get("DS_SKIP_CUDA_CHECK", "0") == "1")
    if status == "fail" and not stage.get("available"):
        # A CUDA wheel on a machine without a GPU (PyPI's torch 2.15.0+cu132 here): DeepSpeed picks its
        # CPU accelerator, whose op builders never run nvcc, so CPU training is not affected.
        status, reason = "warn", (f"{reason}; no GPU is visible, so DeepSpeed runs its CPU accelerator here, "
                                  "which builds no CUDA op: this matters once the machine trains on a GPU")
    advice = {} if status == "ok" else cite(
        knowledge.fix("cuda-version-mismatch", "match-toolkit"),
        torch=".".join(torch_cuda.split(".")[:2]), system=f"{release[0]}.{release[1]}")
    return CheckResult("cuda.match", title, status,
                       f"torch CUDA {torch_cuda}, nvcc {release[0]}.{release[1]}: {reason}",
                       why=knowledge.message("cuda-version-mismatch", "ops-use-nvcc").render(
                           nvcc=toolkit.get("nvcc")),
                       entry=None if status == "ok" else "cuda-version-mismatch", **advice,
                       details=details)


def gpus_result(stage: dict[str, Any], visible: str | None = None) -> CheckResult:
    """Visible GPUs, their memory and bf16 support; with none, say that CPU mode works."""
    title = "GPUs"
    if not stage.get("available"):
        build = "a CPU build of torch" if stage.get("torch_cuda") is None else \
            f"torch built with CUDA {stage['torch_cuda']}, but torch.cuda.is_available() is False"
        if visible is not None:
            build += f"; CUDA_VISIBLE_DEVICES={visible!r}"
        return CheckResult("cuda.gpus", title, "skip", f"no GPU visible ({build})", why=CPU_MODE,
                           details=stage)
    devices = stage.get("devices") or []
    listing = ", ".join(f"{d['name']} {d['total_memory'] / 2**30:.0f} GiB" for d in devices)
    found = f"{stage.get('count', len(devices))} GPU(s): {listing}; bf16 {'yes' if stage.get('bf16') else 'no'}"
    if not stage.get("bf16"):
        return CheckResult("cuda.gpus", title, "warn", found,
                           why=knowledge.message("gpu-without-bf16", "no-bf16").render(),
                           entry="gpu-without-bf16", **cite(knowledge.fix("gpu-without-bf16", "prefer-bf16")),
                           details=stage)
    return CheckResult("cuda.gpus", title, "ok", found, details=stage)
