"""The host: RAM, shared memory, and the locked-memory limit.

Why: ZeRO-3 with offload keeps optimizer states (12 bytes per parameter) and possibly the
parameters in host RAM; NCCL and DataLoader workers exchange data through ``/dev/shm``, which
container runtimes make tiny by default (Docker: 64 MiB); and memory that InfiniBand/RDMA
registers, and the pinned CPU buffers of ZeRO offload, must be locked, so a low ``ulimit -l``
breaks them. DeepSpeed's own
``ds_report`` warns below 512 MiB of ``/dev/shm`` (deepspeed/env_report.py ``get_shm_size``); the
doctor uses the same threshold.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from troubleshooter.doctor.base import CheckResult, DoctorOptions
from troubleshooter.doctor.probes import ProbeSet

SHM_WARN_BYTES = 512 * 2**20
LOW_RAM_BYTES = 2 * 2**30
MEMLOCK_OK_BYTES = 2**30  # "unlimited" is what NVIDIA's container guidance asks for


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """RAM, /dev/shm (at ``options.shm_path``), memlock."""
    return [ram_result(), shm_result(options.shm_path), memlock_result()]


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
    why = ("offloaded optimizer states need ~12 bytes per offloaded parameter on each node, "
           "divided among its ranks.")
    if limit is not None and limit < total:
        return CheckResult(
            "host.ram", "Host RAM", "warn", found + f"; but this container is limited to {gib(limit)}",
            why=why + " Past the cgroup limit the kernel kills the process (exit 137, no Python "
                "error); free/top show the host's memory, not the limit.",
            fix="Size offload and DataLoader workers for the container limit, or raise it.",
            details=details)
    if available is not None and available < LOW_RAM_BYTES:
        return CheckResult("host.ram", "Host RAM", "warn", found,
                           why=why + " With this little free memory, start-up alone (torch, "
                               "deepspeed, the model) can hit the OOM killer.",
                           fix="Stop other jobs on this host or use a larger one.", details=details)
    return CheckResult("host.ram", "Host RAM", "ok", found, why=why, details=details)


def shm_result(path: str) -> CheckResult:
    """Size of the shared-memory file system at ``path``."""
    title = "Shared memory"
    try:
        stats = os.statvfs(path)
    except OSError as err:
        return CheckResult("host.shm", title, "warn", f"{path}: {err.strerror}",
                           why="NCCL and DataLoader workers need a shared-memory file system.",
                           fix="Mount a tmpfs at /dev/shm (docker run --shm-size=8g, or --ipc=host).",
                           entry="shm-too-small", details={"path": path})
    size = stats.f_frsize * stats.f_blocks
    details = {"path": path, "bytes": size, "warn_below": SHM_WARN_BYTES}
    if size < SHM_WARN_BYTES:
        return CheckResult(
            "host.shm", title, "warn", f"{path} is {gib(size)}",
            why="NCCL's intra-node transport and DataLoader workers allocate in /dev/shm; when it "
                "runs out they fail with 'unhandled system error' or bus errors. ds_report warns "
                "below 512 MiB.",
            fix="docker run --shm-size=8g (or --ipc=host); in Kubernetes mount an emptyDir with "
                "medium: Memory at /dev/shm.", entry="shm-too-small", details=details)
    return CheckResult("host.shm", title, "ok", f"{path} is {gib(size)}", details=details)


def memlock_result() -> CheckResult:
    """The soft RLIMIT_MEMLOCK (ulimit -l)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    details = {"soft": soft, "hard": hard}
    title = "Locked-memory limit (ulimit -l)"
    if soft == resource.RLIM_INFINITY or soft >= MEMLOCK_OK_BYTES:
        shown = "unlimited" if soft == resource.RLIM_INFINITY else gib(soft)
        return CheckResult("host.memlock", title, "ok", shown, details=details)
    return CheckResult(
        "host.memlock", title, "warn", f"{gib(soft)} (soft), "
        + ("unlimited" if hard == resource.RLIM_INFINITY else gib(hard)) + " (hard)",
        why="offload with pin_memory (the default) keeps page-locked CPU buffers (deepspeed's "
            "offload_config.py: 'Disable only on hosts with tight memlock limits'; "
            "DS_PIN_MEMORY_BACKEND=native pins with mlock), and RDMA (NCCL over InfiniBand/RoCE) "
            "registers locked memory; a small limit makes either fail.",
        fix="ulimit -l unlimited (limits.conf: '* - memlock unlimited'); in Docker: "
            "--ulimit memlock=-1.", entry="memlock-limit", details=details)
