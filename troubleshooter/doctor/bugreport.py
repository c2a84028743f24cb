"""``doctor --report``: one Markdown block to paste into a GitHub issue.

It holds what maintainers ask for first, the union of what ``ds_report`` and
``torch.utils.collect_env`` print (OS, glibc, gcc, CPU and NUMA, GPU models and driver, CUDA of
torch and of the toolkit, install paths, the torch and CUDA the deepspeed wheel was compiled with,
the versions of the stack, ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` and the other
knobs that change behaviour) followed by every doctor verdict. Everything that runs a program
(gcc, nvidia-smi) is time-limited like the probes; nothing imports torch or deepspeed here (their
facts come from the doctor's probe, the installed metadata and deepspeed's
``git_version_info_installed.py``, parsed, not imported).

Environment values whose name or shape looks like a secret (tokens, keys, passwords) are masked.
"""

from __future__ import annotations

import ast
import os
import platform
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_zeromoe import compat
from troubleshooter.doctor.base import CheckResult, DoctorOptions, run_probe
from troubleshooter.doctor.report import TAGS, summary
from troubleshooter.doctor.versions import package_dir

#: Variables shown (by prefix or name): the ones that change how the stack builds or runs.
ENV_PREFIXES = ("PYTORCH_", "TORCH_", "NCCL_", "CUDA_", "DS_", "DEEPSPEED_", "HF_", "TRANSFORMERS_",
                "OMP_", "MKL_", "KMP_", "LD_PRELOAD", "LD_LIBRARY_PATH", "MASTER_", "WORLD_SIZE",
                "LOCAL_RANK", "RANK", "NODE_RANK", "SLURM_JOB_", "WANDB_", "GLOO_", "UCX_", "FI_")
#: A name that says its value is secret, or a value shaped like a known token format.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|PASSPHRASE|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL|AUTH|COOKIE|SESSION",
                         re.IGNORECASE)
SECRET_VALUE = re.compile(r"^(?:hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|"
                          r"sk-[A-Za-z0-9_-]{20,}|xox[abpr]-[\w-]{10,}|AKIA[0-9A-Z]{16}|"
                          r"eyJ[\w-]{10,}\.[\w-]{10,}\.[\w-]{10,})$")
#: A value embedding credentials in a URL: scheme://user:password@host.
URL_CREDENTIALS = re.compile(r"(\w+://[^/\s:@]+:)[^@\s/]+@")
MASK = "***"
PACKAGES = ("torch", "deepspeed", "lightning", "transformers", "lightning-zeromoe", "accelerate",
            "triton", "numpy", "ninja", "pydantic")


def mask(name: str, value: str) -> str:
    """The value as it may be shown: secrets masked, URL passwords removed."""
    if SECRET_NAME.search(name) or SECRET_VALUE.match(value.strip()):
        return MASK
    return URL_CREDENTIALS.sub(rf"\1{MASK}@", value)


def shown_env(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """The relevant variables that are set, masked, sorted."""
    return sorted((k, mask(k, v)) for k, v in env.items() if k.startswith(ENV_PREFIXES))


def _first_line(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> str:
    """The first output line of a program, or why there is none (time-limited)."""
    path = shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if path is None:
        return f"{argv[0]}: not found"
    outcome = run_probe([path, *argv[1:]], timeout, env=env)
    if not outcome.ok:
        return outcome.describe_failure(timeout)
    lines = [line.strip() for line in outcome.stdout.splitlines() if line.strip()]
    return "; ".join(lines) if argv[0] == "nvidia-smi" else (lines[0] if lines else "no output")


def os_facts() -> dict[str, str]:
    """OS release, kernel, glibc, architecture."""
    release = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                release = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    libc = " ".join(platform.libc_ver()) or (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "")
    return {"os": release or platform.platform(), "kernel": platform.release(),
            "glibc": libc.strip() or "unknown", "arch": platform.machine(),
            "python": f"{platform.python_version()} ({sys.executable})"}


def cpu_facts() -> dict[str, str]:
    """CPU model, cores usable by this process, NUMA nodes."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    numa = ", ".join(f"{n.name}: cpus {(n / 'cpulist').read_text().strip()}" for n in nodes
                     if (n / "cpulist").is_file()) or "no NUMA information"
    return {"cpu": model or platform.processor() or "unknown",
            "cores": f"{os.cpu_count()} ({usable} usable by this process)",
            "numa": f"{len(nodes)} node(s): {numa}" if nodes else numa}


def deepspeed_build() -> str:
    """'torch X, cuda Y' the installed deepspeed wheel was compiled with (ds_report's line)."""
    root = package_dir("deepspeed")
    path = root / "git_version_info_installed.py" if root else None
    if path is None or not path.is_file():
        return "unknown (no git_version_info_installed.py)"
    for node in ast.parse(path.read_text(errors="replace")).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "torch_info":
            try:
                info = ast.literal_eval(node.value)
            except ValueError:
                break
            hip = info.get("hip_version", "0.0")
            return f"torch {info.get('version')}, " + (f"hip {hip}" if hip not in ("0.0", None)
                                                        else f"cuda {info.get('cuda_version')}")
    return "unknown"


def package_facts() -> list[tuple[str, str]]:
    """(name, 'version at path') for the stack, from metadata and find_spec (no imports)."""
    rows = []
    for name in PACKAGES:
        version = compat.installed_version(name)
        where = package_dir(name.replace("-", "_"))
        rows.append((name, f"{version or 'not installed'}" + (f" ({where})" if version and where else "")))
    return rows


def _by_id(results: Sequence[CheckResult]) -> dict[str, CheckResult]:
    return {r.id: r for r in results}


def gpu_facts(results: Sequence[CheckResult], options: DoctorOptions) -> dict[str, str]:
    """torch's CUDA, the GPUs, the driver (nvidia-smi), the toolkit: from the doctor's results."""
    ids = _by_id(results)
    facts: dict[str, str] = {}
    match = ids.get("cuda.match")
    if match is not None:
        facts["torch CUDA"] = str(match.details.get("torch_cuda") or "none (CPU build)")
    toolkit = ids.get("cuda.toolkit")
    if toolkit is not None:
        facts["CUDA toolkit"] = toolkit.found
    gpus = ids.get("cuda.gpus")
    if gpus is not None:
        facts["GPUs (torch)"] = gpus.found
    facts["driver (nvidia-smi)"] = _first_line(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        options.env, min(options.timeout, 20.0))
    nccl = ids.get("nccl.available")
    if nccl is not None:
        facts["NCCL"] = nccl.found
    return facts


def _section(title: str, rows: Sequence[tuple[str, str]]) -> list[str]:
    return [f"**{title}**", ""] + [f"- {k}: {v}" for k, v in rows] + [""]


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def render(results: Sequence[CheckResult], options: DoctorOptions, version: str) -> str:
    """The Markdown report: facts, environment, then every check's verdict."""
    s = summary(list(results))
    compiler = {"gcc": _first_line(["gcc", "--version"], options.env, min(options.timeout, 20.0)),
                "c++ ($CXX or c++)": _first_line([options.env.get("CXX") or "c++", "--version"],
                                                 options.env, min(options.timeout, 20.0)),
                "nvcc": _by_id(results).get("cuda.toolkit").found if "cuda.toolkit" in _by_id(results) else "not checked"}
    ids = _by_id(results)
    host = [(k, v) for k, v in (("RAM", ids["host.ram"].found if "host.ram" in ids else ""),
                                ("/dev/shm", ids["host.shm"].found if "host.shm" in ids else ""),
                                ("ulimit -l", ids["host.memlock"].found if "host.memlock" in ids else "")) if v]
    ops = ids.get("build.ops")
    deepspeed = [("compiled with", deepspeed_build()),
                 ("ops", ops.found if ops is not None else "not checked")]
    env = shown_env(options.env)
    lines = ["<!-- python -m troubleshooter doctor --report: paste this whole block into the issue -->",
             "<details open><summary>Environment (troubleshooter doctor --report)</summary>", "",
             f"troubleshooter {version}: {s['ok']} ok, {s['warn']} warn, {s['fail']} fail, "
             f"{s['error']} error, {s['skip']} skipped", ""]
    lines += _section("System", [*os_facts().items(), *cpu_facts().items(), *host])
    lines += _section("Compilers", list(compiler.items()))
    lines += _section("GPU and CUDA", list(gpu_facts(results, options).items()))
    lines += _section("Packages", package_facts())
    lines += _section("DeepSpeed", deepspeed)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name not in options.env:
            env.append((name, "(not set)"))
    lines += _section("Environment (secrets masked)", sorted(env))
    lines += _hang_dumps(options)
    lines += ["**Checks**", "", "| | check | found |", "|---|---|---|"]
    lines += [f"| {TAGS[r.status].strip('[]').strip()} | {_cell(r.title)} | {_cell(r.found)} |" for r in results]
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def _hang_dumps(options: DoctorOptions) -> list[str]:
    """The Flight Recorder dumps of a run (``--dumps DIR``, else ``./flight_recorder`` when it holds a trace
    from the last 15 minutes): where they are and what ``explain`` makes of them."""
    from troubleshooter import hangs

    if options.dumps:
        found = [Path(options.dumps)] if hangs.is_dump_dir(Path(options.dumps)) else []
        if not found:
            return ["**Flight Recorder dumps**", "", f"{options.dumps}: no rank<N> / process<N>.json here", ""]
    else:
        found = hangs.recent_dump_dirs([Path.cwd() / "flight_recorder"])
    lines = []
    for directory in found:
        lines += ["**Flight Recorder dumps**", "", "```", *hangs.summary_lines(directory), "```", ""]
    return lines


def report_facts(results: Sequence[CheckResult], options: DoctorOptions) -> dict[str, Any]:
    """The same facts as a dict (for tests and tools)."""
    return {"os": os_facts(), "cpu": cpu_facts(), "gpu": gpu_facts(results, options),
            "packages": dict(package_facts()), "deepspeed_compiled_with": deepspeed_build(),
            "env": dict(shown_env(options.env))}
