"""The one subprocess probe that needs heavy imports, started at once and shared by the checks.

It imports torch (about 2 s) and reports in stages, one JSON line per stage, so a stage that
hangs (CUDA initialisation, a gloo rendezvous) still leaves the earlier stages' answers:

* ``cuda``: torch.version.cuda, the GPUs, their memory and bf16 support;
* ``nccl``: NCCL availability and version;
* ``subgroup``: does ``new_group(ranks)`` inherit the world group's timeout? (measured);
* ``ops``: the op table the way ``ds_report`` computes it (deepspeed/env_report.py
  ``op_report``), without printing it.

Why one process and not one per family: on a small machine the cost is the torch import, and
paying it once keeps the doctor as fast as ``ds_report`` (which pays it too) while checking more.
The probe starts before the cheap checks run, so those overlap with it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from troubleshooter.doctor.base import ProbeOutcome, json_lines, kill_group, run_python_probe

#: Each stage prints ``{"stage": name, ...}``; an exception inside a stage is reported, not raised.
PROBE = r'''
import json, os, sys, tempfile, time

def emit(stage, **data):
    print(json.dumps({"stage": stage, **data}, default=str), flush=True)

def cuda_stage():
    import torch
    info = {"torch_cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    info["available"] = bool(torch.cuda.is_available())
    info["count"] = int(torch.cuda.device_count()) if info["available"] else 0
    devices = []
    for index in range(info["count"]):
        props = torch.cuda.get_device_properties(index)
        devices.append({"index": index, "name": props.name,
                        "total_memory": int(props.total_memory),
                        "capability": f"{props.major}.{props.minor}"})
    info["devices"] = devices
    info["bf16"] = bool(torch.cuda.is_bf16_supported()) if info["available"] else None
    return info

def nccl_stage():
    import torch
    import torch.distributed as dist
    info = {"distributed": bool(dist.is_available()), "torch_cuda": torch.version.cuda}
    info["nccl_available"] = bool(info["distributed"] and dist.is_nccl_available())
    info["version"] = None
    if info["nccl_available"] and torch.version.cuda is not None:
        version = torch.cuda.nccl.version()
        info["version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    from torch.distributed import constants
    nccl_default = getattr(constants, "default_pg_nccl_timeout", None)
    info["default_nccl_timeout_s"] = nccl_default.total_seconds() if nccl_default else None
    return info

def subgroup_stage():
    # Mirrors deepspeed/utils/groups.py: init the world group with an explicit timeout, then
    # create an expert group with new_group(ranks) and no timeout; read both groups' timeouts.
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    world_timeout = timedelta(minutes=17)
    store = os.path.join(tempfile.mkdtemp(prefix="doctor-pg-"), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1,
                            timeout=world_timeout)
    try:
        sub = dist.new_group([0])
        def timeout_of(group):
            from lightning_zeromoe._private.torch import group_timeout
            return group_timeout(group).total_seconds()
        return {"backend": "gloo", "world_size": 1,
                "requested_world_timeout_s": world_timeout.total_seconds(),
                "world_timeout_s": timeout_of(dist.group.WORLD),
                "subgroup_timeout_s": timeout_of(sub),
                "backend_default_s": c10d._get_default_timeout(dist.Backend("gloo")).total_seconds(),
                "nccl_default_s": (c10d.default_pg_nccl_timeout.total_seconds()
                                   if c10d.default_pg_nccl_timeout else None),
                "read_via": "lightning_zeromoe._private.torch.group_timeout"}
    finally:
        dist.destroy_process_group()

def ops_stage():
    # The op table of deepspeed/env_report.py op_report: same builders, same two columns.
    import contextlib
    with contextlib.redirect_stdout(sys.stderr):  # builders print warnings; stdout is for JSON
        import deepspeed
        from torch.utils.cpp_extension import is_ninja_available
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible
        from deepspeed.git_version_info import installed_ops, accelerator_name
        accelerator = get_accelerator()._name
        ops = {}
        import io, re
        for name, builder in ALL_OPS.items():
            # verbose, as ds_report asks: the builders print why an op cannot be built
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                compatible = bool(probe_is_compatible(builder, True))
            installed = bool(installed_ops.get(name, False) and accelerator_name == accelerator)
            warnings = [re.sub(r"\x1b\[[0-9;]*m|\[WARNING\]", "", line).strip()
                        for line in said.getvalue().splitlines() if "WARNING" in line]
            reason = "; ".join(dict.fromkeys(w for w in warnings if w)) or getattr(builder, "error_log", None)
            ops[name] = {"compatible": compatible, "installed": installed,
                         "reason": (str(reason)[:500] if reason and not compatible else None)}
        ninja = bool(is_ninja_available())
    return {"deepspeed": deepspeed.__version__, "accelerator": accelerator,
            "installed_for": accelerator_name, "ninja": ninja, "ops": ops}

STAGES = {"cuda": cuda_stage, "nccl": nccl_stage, "subgroup": subgroup_stage, "ops": ops_stage}
start = time.monotonic()
import torch
emit("import", torch=torch.__version__, seconds=round(time.monotonic() - start, 3))
for name in sys.argv[1:]:
    begun = time.monotonic()
    try:
        result = STAGES[name]()
    except BaseException as err:
        result = {"exception": f"{type(err).__name__}: {err}"}
    emit(name, seconds=round(time.monotonic() - begun, 3), **result)
# Everything is on stdout. Tearing torch and deepspeed down costs more than the work itself
# (measured: seconds on a busy 2-core machine), and nothing here needs cleaning up.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''

#: The probe stages each check family reads. The probe is started from this table before the
#: check modules are even imported, so it gets a head start.
FAMILY_STAGES = {"cuda": ("cuda",), "nccl": ("nccl",), "timeouts": ("subgroup",), "build": ("ops",)}

#: The order the probe runs its stages: torch-only stages first, so a deepspeed that fails to
#: import (a non-integer DEEPSPEED_TIMEOUT, say) costs only the op table.
STAGE_ORDER = ("cuda", "nccl", "subgroup", "ops")


class ProbeSet:
    """Starts the probe with the stages the selected checks need, and hands out their answers."""

    def __init__(self, timeout: float, env: Mapping[str, str]) -> None:
        self.timeout = timeout
        self.env = dict(env)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="doctor-probe")
        self._future: Future[ProbeOutcome] | None = None
        self._procs: list[subprocess.Popen] = []
        self.stages: tuple[str, ...] = ()

    def start(self, stages: Sequence[str]) -> None:
        """Launch the probe in the background for ``stages`` (run in STAGE_ORDER), if any."""
        self.stages = tuple(s for s in STAGE_ORDER if s in set(stages))
        if self.stages and self._future is None:
            self._future = self._pool.submit(run_python_probe, PROBE, list(self.stages),
                                             self.timeout, self.env, self._procs.append)

    def outcome(self) -> ProbeOutcome:
        """Wait for the probe (it is time-limited, so this wait is bounded)."""
        if self._future is None:
            raise RuntimeError("the probe was not started for any stage")
        return self._future.result()

    def stage(self, name: str) -> tuple[dict[str, Any] | None, ProbeOutcome]:
        """The JSON the stage emitted (None if the probe never got there) and the outcome."""
        if name not in self.stages:
            raise RuntimeError(f"probe stage {name!r} was not requested")
        outcome = self.outcome()
        for record in json_lines(outcome.stdout):
            if record.get("stage") == name:
                return record, outcome
        return None, outcome

    def close(self) -> None:
        """Kill the probe if no check waited for it (or on Ctrl-C), then release the thread."""
        for proc in self._procs:
            if proc.poll() is None:
                kill_group(proc)
        self._pool.shutdown(wait=True)
