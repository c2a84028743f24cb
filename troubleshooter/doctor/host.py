"""The host: RAM, shared memory, and the locked-memory limit.

Why: ZeRO-3 with offload keeps the model states in host RAM: DeepSpeed's own estimator
(``estimate_zero3_model_states_mem_needs`` in deepspeed/runtime/zero/stage3.py) plans 16 bytes per
parameter with ``offload_optimizer`` (fp32 master weights, Adam's two moments, fp32 gradients),
18 with ``offload_param`` as well, times a 1.5 buffer factor, per node; NCCL and DataLoader workers exchange data through ``/dev/shm``, which
container runtimes make tiny by default (Docker: 64 MiB); and memory that InfiniBand/RDMA
registers, and the pinned CPU buffers of ZeRO offload, must be locked, so a low ``ulimit -l``
breaks them. DeepSpeed's own
``ds_report`` warns below 512 MiB of ``/dev/shm`` (deepspeed/env_report.py ``get_shm_size``); the
doctor uses the same threshold.
"""

from __future__ import annotations

import os
try:  # POSIX only
    import resource
except ImportError:  # Windows: no ulimit to read
    resource = None  # type: ignore[assignment]
from pathlib import Path

from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite, process_ids
from troubleshooter.doctor.probes import ProbeSet

#: deepspeed 0.19.8 estimate_zero3_model_states_mem_needs (zero_init=True): host bytes per
#: parameter with offload_param off / on, and its additional_buffer_factor default.
OFFLOAD_BYTES_PER_PARAM = {False: 16, True: 18}
OFFLOAD_BUFFER_FACTOR = 1.5
SHM_WARN_BYTES = 512 * 2**20
LOW_RAM_BYTES = 2 * 2**30
MEMLOCK_OK_BYTES = 2**30  # "unlimited" is what NVIDIA's container guidance asks for


#: DeepSpeed's CPU all-reduce buffers (``lightning_zeromoe.engine.processes.SHM_BUFFER_NAME``; a test keeps the
#: two the same): one per rank of a CPU run whose ranks are all on one host, which DeepSpeed never removes.
DEEPSPEED_SHM_BUFFERS = "deepspeed_allreduce_buffer_*"


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """RAM, /dev/shm (at ``options.shm_path``) and what DeepSpeed left there, memlock."""
    return [ram_result(), shm_result(options.shm_path), shm_leftovers_result(options.shm_path), memlock_result()]


def offload_host_bytes(params: int, *, offload_params: bool, nodes: int = 1) -> int:
    """Host RAM per node for offloaded ZeRO-3 model states, as DeepSpeed's estimator computes it."""
    return int(params * OFFLOAD_BYTES_PER_PARAM[offload_params] / nodes * OFFLOAD_BUFFER_FACTOR)


def params_that_fit(host_bytes: int, *, offload_params: bool) -> int:
    """The most parameters whose offloaded states ``host_bytes`` of one node hold (one node)."""
    return int(host_bytes / (OFFLOAD_BYTES_PER_PARAM[offload_params] * OFFLOAD_BUFFER_FACTOR))


def count(params: int) -> str:
    """A parameter count for people: 1.2 B, 350 M."""
    return f"{params / 1e9:.1f} B" if params >= 1e9 else f"{params / 1e6:.0f} M"


def gib(value: float) -> str:
    """Bytes as GiB with one decimal (MiB below 1 GiB), for humans."""
    return f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is no /proc)."""
    values: dict[str, int] = {}
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return values
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["a/b", "a", ""]``: a limit on any enclosing cgroup applies too."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _limit_files(proc_cgroup: str, root: Path) -> list[Path]:
    """The memory-limit files of this process's cgroup and its parents, v2 and v1 layouts."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: "0::/path"
            for base in (root, root / "unified"):
                files += [base / rel / "memory.max" for rel in _ancestors(path)]
        elif "memory" in controllers.split(","):  # cgroup v1
            files += [root / "memory" / rel / "memory.limit_in_bytes" for rel in _ancestors(path)]
    return files


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest cgroup memory limit on this process (a container's), if any."""
    limits = []
    for path in _limit_files(proc_cgroup, Path(root)):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 writes ~2**63 for "no limit", v2 "max"
            limits.append(int(text))
    return min(limits) if limits else None


def ram_result() -> CheckResult:
    """Total and available host RAM, and any container limit under it."""
    info = meminfo()
    total, available, limit = info.get("MemTotal"), info.get("MemAvailable"), cgroup_limit()
    details = {"total": total, "available": available, "cgroup_limit": limit}
    if total is None:
        return CheckResult("host.ram", "Host RAM", "skip", "no /proc/meminfo on this system",
                           details=details)
    found = f"{gib(total)} total, {gib(available or 0)} available"
    usable = min(x for x in (available or total, limit or total) if x)
    why = knowledge.message("cpu-oom", "offload-host-ram").render(
        available=gib(usable), params_optimizer=count(params_that_fit(usable, offload_params=False)),
        params_param=count(params_that_fit(usable, offload_params=True)))
    if limit is not None and limit < total:
        return CheckResult(
            "host.ram", "Host RAM", "warn", found + f"; but this container is limited to {gib(limit)}",
            why=why + " " + knowledge.message("cpu-oom", "container-limit").render(limit=gib(limit)),
            entry="cpu-oom", **cite(knowledge.fix("cpu-oom", "fit-container-limit"), limit=gib(limit)),
            details=details)
    if available is not None and available < LOW_RAM_BYTES:
        return CheckResult("host.ram", "Host RAM", "warn", found,
                           why=why + " " + knowledge.message("cpu-oom", "low-ram").render(available=gib(available)),
                           entry="cpu-oom", **cite(knowledge.fix("cpu-oom", "free-host-memory")),
                           details=details)
    return CheckResult("host.ram", "Host RAM", "ok", found, why=why, details=details)


def shm_result(path: str) -> CheckResult:
    """Size of the shared-memory file system at ``path``."""
    title = "Shared memory"
    try:
        stats = os.statvfs(path)
    except OSError as err:
        return CheckResult("host.shm", title, "warn", f"{path}: {err.strerror}",
                           why=knowledge.message("shm-too-small", "shm-unreadable").render(
                               path=path, error=err.strerror),
                           entry="shm-too-small", **cite(knowledge.fix("shm-too-small", "raise-shm-size")),
                           details={"path": path})
    size = stats.f_frsize * stats.f_blocks
    details = {"path": path, "bytes": size, "warn_below": SHM_WARN_BYTES}
    if size < SHM_WARN_BYTES:
        return CheckResult(
            "host.shm", title, "warn", f"{path} is {gib(size)}",
            why=knowledge.message("shm-too-small", "shm-small").render(path=path, size=gib(size)),
            entry="shm-too-small", **cite(knowledge.fix("shm-too-small", "raise-shm-size")),
            details=details)
    return CheckResult("host.shm", title, "ok", f"{path} is {gib(size)}", details=details)


def mapped_by(paths: list[Path]) -> dict[str, list[int]]:
    """Which processes map each file (``/proc/<pid>/maps``; of the processes this user may read)."""
    found: dict[str, list[int]] = {str(p): [] for p in paths}
    folders = {str(p.parent) + "/" for p in paths}
    for pid in process_ids() if paths else ():
        try:
            text = Path(f"/proc/{pid}/maps").read_text(errors="replace")
        except OSError:
            continue
        if not any(folder in text for folder in folders):
            continue
        mapped = {fields[5] for line in text.splitlines() if len(fields := line.split(None, 5)) == 6}
        for path in mapped & found.keys():
            found[path].append(int(pid))
    return found


def shm_leftovers_result(path: str) -> CheckResult:
    """DeepSpeed's CPU all-reduce buffers in ``path`` that this user owns and no process maps."""
    title = "DeepSpeed buffers left in shared memory"
    root = Path(path)
    if not hasattr(os, "getuid") or not root.is_dir():
        return CheckResult("host.shm_leftovers", title, "skip", f"no {path} to look in")
    buffers = []
    for buffer in sorted(root.glob(DEEPSPEED_SHM_BUFFERS)):
        try:
            stat = buffer.stat()
        except FileNotFoundError:  # its run removed it meanwhile
            continue
        if stat.st_uid == os.getuid():
            buffers.append((buffer, stat.st_blocks * 512))
    maps = mapped_by([b for b, _ in buffers])
    rows = [{"path": str(b), "bytes": size, "mapped_by": maps[str(b)]} for b, size in buffers]
    left = [r for r in rows if not r["mapped_by"]]
    details = {"path": path, "buffers": rows}
    if left:
        size = gib(sum(r["bytes"] for r in left))
        return CheckResult(
            "host.shm_leftovers", title, "warn", f"{len(left)} in {path}, mapped by no process: {size}",
            why=knowledge.message("deepspeed-shm-buffers-left", "buffers-left").render(
                count=len(left), size=size, path=path),
            entry="deepspeed-shm-buffers-left",
            **cite(knowledge.fix("deepspeed-shm-buffers-left", "remove-left-buffers"),
                   paths=" ".join(r["path"] for r in left)), details=details)
    found = f"{len(rows)} in {path}, each mapped by a running process" if rows else f"none in {path}"
    return CheckResult("host.shm_leftovers", title, "ok", found, details=details)


def memlock_result() -> CheckResult:
    """The soft RLIMIT_MEMLOCK (ulimit -l)."""
    title = "Locked-memory limit (ulimit -l)"
    if resource is None or not hasattr(resource, "RLIMIT_MEMLOCK"):
        return CheckResult("host.memlock", title, "skip", "no RLIMIT_MEMLOCK on this system")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    details = {"soft": soft, "hard": hard}
    if soft == resource.RLIM_INFINITY or soft >= MEMLOCK_OK_BYTES:
        shown = "unlimited" if soft == resource.RLIM_INFINITY else gib(soft)
        return CheckResult("host.memlock", title, "ok", shown, details=details)
    return CheckResult(
        "host.memlock", title, "warn", f"{gib(soft)} (soft), "
        + ("unlimited" if hard == resource.RLIM_INFINITY else gib(hard)) + " (hard)",
        why=knowledge.message("memlock-limit", "memlock-low").render(soft=gib(soft)),
        entry="memlock-limit", **cite(knowledge.fix("memlock-limit", "raise-memlock")), details=details)
