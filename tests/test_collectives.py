"""``lightning_zeromoe.engine.collectives``: the device choice per backend, real collectives, and one place.

* The device choice (:func:`device_for_backend`) is pure, so every backend string is checked here
  without a GPU; the CUDA index is passed in. What only a GPU can confirm: that NCCL really refuses
  a CPU tensor ("No backend type associated with device type cpu") and accepts the chosen
  ``cuda:<current>`` copy, that results come back on the CPU, and that the barrier pinned to the
  current device works. :func:`test_single_gpu_nccl_and_mixed_backends` checks exactly that and
  is skipped on a machine without CUDA.
* Two real ranks over gloo (``tests/jobs/collectives_job.py``, TCP rendezvous on free ports) call
  every wrapper and two of the package's call sites, for ``gloo``, ``cpu:gloo`` and no backend.
* An AST scan fails when any module of ``lightning_zeromoe/`` or ``troubleshooter/`` other than
  ``lightning_zeromoe/engine/collectives.py`` calls a ``torch.distributed`` or ``deepspeed.comm``
  collective itself; the scanner is checked on small sources first.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import JOBS, REPO, free_port, job_env

from lightning_zeromoe.engine.collectives import (KNOWN_BACKENDS, UnknownBackendError, backend_device_types,
                                           device_for_backend)

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The device choice, per backend string (pure)
# ---------------------------------------------------------------------------------------------

def test_nccl_is_the_current_cuda_device_whatever_the_tensor():
    assert device_for_backend("nccl", cuda_index=3) == torch.device("cuda", 3)
    assert device_for_backend("nccl", CPU, cuda_index=3) == torch.device("cuda", 3)
    assert device_for_backend("NCCL", "cpu", cuda_index=0) == torch.device("cuda", 0)
    # a tensor already on a CUDA device stays where it is (no copy)
    assert device_for_backend("nccl", torch.device("cuda", 1), cuda_index=0) == torch.device("cuda", 1)
    # no index known: torch's "cuda" (the current device when a tensor is moved there)
    assert device_for_backend("nccl", CPU) == torch.device("cuda")


def test_gloo_and_mpi_are_the_cpu_whatever_the_tensor():
    for backend in ("gloo", "mpi"):
        assert device_for_backend(backend) == CPU
        assert device_for_backend(backend, CPU, cuda_index=0) == CPU
        assert device_for_backend(backend, torch.device("cuda", 1), cuda_index=1) == CPU


def test_mixed_backend_keeps_a_served_tensor_where_it_is_and_prefers_the_cpu_otherwise():
    for backend in ("cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", " cpu : gloo , cuda : nccl "):
        assert backend_device_types(backend) == ("cpu", "cuda")
        assert device_for_backend(backend, cuda_index=2) == CPU
        assert device_for_backend(backend, CPU, cuda_index=2) == CPU
        assert device_for_backend(backend, torch.device("cuda", 1), cuda_index=0) == torch.device("cuda", 1)
    # a type the string does not serve goes to the first one it names (cpu when named)
    assert device_for_backend("cpu:gloo,cuda:nccl", torch.device("xpu", 0)) == CPU
    assert device_for_backend("cuda:nccl", CPU, cuda_index=1) == torch.device("cuda", 1)
    assert device_for_backend("xpu:xccl,cuda:nccl", CPU) == torch.device("xpu")


def test_malformed_mixed_backend_is_a_clear_error():
    for bad in ("cpu:gloo,cuda", "cpu:gloo,:nccl", "cpu:gloo:x"):
        with pytest.raises(UnknownBackendError, match="device:backend"):
            device_for_backend(bad)


def test_no_backend_follows_the_accelerator_like_torch_does():
    assert device_for_backend("undefined") == CPU
    assert device_for_backend("undefined", accelerator="cpu") == CPU
    assert device_for_backend("undefined", CPU, accelerator="cuda", cuda_index=1) == torch.device("cuda", 1)
    with pytest.raises(UnknownBackendError, match="without a backend"):
        device_for_backend("undefined", accelerator="tpu", default_device_backend_map={"cpu": "gloo"},
                           backend_capability={})


def test_a_cuda_build_without_a_gpu_has_no_accelerator(monkeypatch):
    """torch's CUDA wheel on a CPU machine (2.15.0+cu132 from PyPI, measured here): ``current_accelerator()``
    says ``cuda`` although ``is_available()`` is False, and the two-rank gloo job of this module then
    died in ``torch.cuda.current_device()`` ("Found no NVIDIA driver"). The two answers of that build
    are put on whatever torch runs this test (the CPU build answers None by itself)."""
    from lightning_zeromoe.engine import collectives

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert collectives._accelerator_type() is None


def test_other_backends_use_torch_registry_of_devices():
    # Habana registers hccl as the hpu default; oneCCL declares cpu and xpu.
    registry = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}
    capability = {"ccl": ["cpu", "xpu"], "hccl": ["hpu"]}
    assert device_for_backend("hccl", CPU, default_device_backend_map=registry,
                              backend_capability=capability) == torch.device("hpu")
    assert device_for_backend("ccl", default_device_backend_map=registry, backend_capability=capability) == CPU
    assert device_for_backend("ccl", torch.device("xpu", 1), default_device_backend_map=registry,
                              backend_capability=capability) == torch.device("xpu", 1)
    # torch's own tables, read when none are passed: a device type torch declares for its fake
    # backend (which ones can change while the process runs: plugins register more)
    declared = set(torch.distributed.Backend.backend_capability["fake"])
    assert declared and device_for_backend("fake").type in declared


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(UnknownBackendError, match="'foo'.*register_backend"):
        device_for_backend("foo", default_device_backend_map={"cpu": "gloo"}, backend_capability={})
    with pytest.raises(UnknownBackendError, match="'made-up-backend'"):
        device_for_backend("made-up-backend")  # torch's live tables know nothing of it


def test_known_backends_agree_with_torch_capability_table():
    """A torch upgrade that drops a device type from a backend we route through fails here."""
    from torch.distributed import Backend

    for backend, types in KNOWN_BACKENDS.items():
        assert set(types) <= set(Backend.backend_capability[backend]), backend
    assert Backend.default_device_backend_map["cuda"] == "nccl"
    assert Backend.default_device_backend_map["cpu"] == "gloo"


# ---------------------------------------------------------------------------------------------
# Real collectives
# ---------------------------------------------------------------------------------------------

def _run_ranks(tmp_path: Path, backends: list[str], world: int, timeout: float = 240) -> list[dict]:
    ports = ",".join(str(free_port()) for _ in backends)
    cmd = [sys.executable, str(JOBS / "collectives_job.py"), "--ports", ports, "--backends", ";".join(backends),
           "--out", str(tmp_path), "--world", str(world)]
    procs = [subprocess.Popen([*cmd, "--rank", str(rank)], cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(world)]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}\n{err[-6000:]}"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


def _on_cpu(record: dict, dtype: str, value: list, same_object: bool = True) -> None:
    assert record == {"value": value, "device": "cpu", "dtype": dtype, "same_object": same_object}


def test_two_gloo_ranks_get_correct_results_on_the_callers_device_and_dtype(tmp_path):
    ranks = _run_ranks(tmp_path, ["gloo", "cpu:gloo", "none"], world=2)
    for rank, result in enumerate(ranks):
        assert list(result) == ["gloo", "cpu:gloo", "none"]
        for backend, got in result.items():
            assert got["backend"] == {"none": "undefined"}.get(backend, backend)
            assert got["device"] == "cpu" and got["initialized"] is True
            _on_cpu(got["sum_float32"], "torch.float32", [3.0, 30.0])
            _on_cpu(got["min_int32"], "torch.int32", [0, 4])
            noncontiguous = got.pop("sum_noncontiguous")
            assert noncontiguous.pop("base") == [[0, 3, 6], [9, 12, 15]]  # written back through the view
            assert noncontiguous.pop("contiguous") is False
            _on_cpu(noncontiguous, "torch.int64", [[0, 9], [3, 12], [6, 15]])
            _on_cpu(got["broadcast_float64"], "torch.float64", [1.0, 1.0, 1.0])
            for r, gathered in enumerate(got["all_gather_int32"]):
                _on_cpu(gathered, "torch.int32", [r, 100 + r], same_object=False)
            assert got["all_gather_object"] == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]
            assert got["broadcast_object_list"] == [{"from": 0}, [0, 0]]
            _on_cpu(got["subgroup_bfloat16"], "torch.bfloat16", [3.0, 3.0])
            # rank 1 is outside new_group([0]): nothing runs, its tensor is untouched
            _on_cpu(got["outside_group"]["all_reduce"], "torch.int64", [7 + rank])
            assert got["outside_group"]["all_gather_object"] == ([0] if rank == 0 else [])
            assert got["agree_over_ranks"] == [True, False, False, True]
            [(_, counts)] = got["global_counts"].items()
            _on_cpu(counts, "torch.float32", [3.0, 2.0], same_object=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_single_gpu_nccl_and_mixed_backends(tmp_path):
    """World of one on cuda:0: bare NCCL refuses a CPU tensor; the wrappers run it there and hand it back."""
    [result] = _run_ranks(tmp_path, ["nccl", "cpu:gloo,cuda:nccl"], world=1)
    nccl, mixed = result["nccl"], result["cpu:gloo,cuda:nccl"]
    assert nccl["device"] == "cuda:0" and mixed["device"] == "cpu"
    assert "No backend type associated with device type cpu" in nccl["raw_cpu_all_reduce"]
    assert mixed["raw_cpu_all_reduce"] is None
    for got in (nccl, mixed):
        _on_cpu(got["min_int32"], "torch.int32", [3, 1])
        assert got["sum_cuda_bfloat16"] == {"value": [1.0, 1.0], "device": "cuda:0", "dtype": "torch.bfloat16",
                                            "same_object": True}
        _on_cpu(got["broadcast_float64"], "torch.float64", [5.0, 5.0])
        [gathered] = got["all_gather_int32"]
        _on_cpu(gathered, "torch.int32", [4], same_object=False)
        assert got["all_gather_object"] == [{"rank": 0}]
        assert got["broadcast_object_list"] == [{"from": 0}]
        assert got["agree_over_ranks"] == [True, False]
        [(_, counts)] = got["global_counts"].items()
        _on_cpu(counts, "torch.float32", [2.0, 1.0], same_object=False)


# ---------------------------------------------------------------------------------------------
# One place: no collective called anywhere else
# ---------------------------------------------------------------------------------------------

COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
    "gather_object", "scatter", "scatter_object_list", "barrier", "send", "recv", "isend", "irecv",
    "monitored_barrier",
})
#: Modules whose attributes of those names are collectives.
COLLECTIVE_MODULES = frozenset({"torch.distributed", "torch.distributed.distributed_c10d",
                                "torch.distributed._functional_collectives", "deepspeed.comm", "deepspeed.comm.comm"})
ALLOWED = {Path("lightning_zeromoe/engine/collectives.py")}


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` with its first name replaced by what an import bound it to; None if not a plain chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def direct_collectives(source: str) -> list[str]:
    """``"line: name"`` for every collective of :data:`COLLECTIVE_MODULES` that ``source`` uses itself.

    Imports anywhere in the file bind names (``import torch.distributed as dist``, ``from torch
    import distributed``, ``from deepspeed import comm``, ``from torch.distributed import barrier as
    b``); a use is any reference resolving to ``<collective module>.<collective>``, called or not,
    an import of one by name, or ``getattr(<collective module>, "<collective>")``.
    """
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if node.module in COLLECTIVE_MODULES and a.name in COLLECTIVES:
                    found.append(f"{node.lineno}: {full} (imported)")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and not isinstance(getattr(node, "ctx", None), ast.Store):
            name = _dotted(node, aliases)
            module, _, attr = (name or "").rpartition(".")
            if module in COLLECTIVE_MODULES and attr in COLLECTIVES:
                found.append(f"{node.lineno}: {name}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            if _dotted(node.args[0], aliases) in COLLECTIVE_MODULES and node.args[1].value in COLLECTIVES:
                found.append(f"{node.lineno}: getattr(..., {node.args[1].value!r})")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_scanner_catches_every_collective_name(name):
    assert direct_collectives(f"import torch.distributed as dist\ndist.{name}(x)\n") == [f"2: torch.distributed.{name}"]


@pytest.mark.parametrize("source, expected", [
    ("import torch\ntorch.distributed.all_reduce(t)", ["2: torch.distributed.all_reduce"]),
    ("import torch.distributed\ntorch.distributed.barrier()", ["2: torch.distributed.barrier"]),
    ("import torch as th\nth.distributed.broadcast(t, 0)", ["2: torch.distributed.broadcast"]),
    ("from torch import distributed as d\nd.all_gather_object(o, x)", ["2: torch.distributed.all_gather_object"]),
    ("from torch import distributed\ndistributed.send(t, 1)", ["2: torch.distributed.send"]),
    ("from torch.distributed import all_reduce\nall_reduce(t)",
     ["1: torch.distributed.all_reduce (imported)", "2: torch.distributed.all_reduce"]),
    ("from torch.distributed import barrier as b\nb()",
     ["1: torch.distributed.barrier (imported)", "2: torch.distributed.barrier"]),
    ("def f():\n    import torch.distributed as dist\n    return dist.all_to_all_single(o, i)",
     ["3: torch.distributed.all_to_all_single"]),
    ("from torch.distributed import distributed_c10d as c10d\nc10d.reduce_scatter_tensor(o, i)",
     ["2: torch.distributed.distributed_c10d.reduce_scatter_tensor"]),
    ("import torch.distributed as dist\nop = dist.all_reduce\nop(t)", ["2: torch.distributed.all_reduce"]),
    ("import functools, torch\nf = functools.partial(torch.distributed.barrier, group=g)",
     ["2: torch.distributed.barrier"]),
    ("import torch.distributed as dist\ngetattr(dist, 'monitored_barrier')()",
     ["2: getattr(..., 'monitored_barrier')"]),
    ("import deepspeed\ndeepspeed.comm.all_reduce(t)", ["2: deepspeed.comm.all_reduce"]),
    ("import deepspeed.comm as dist\ndist.all_to_all_single(o, i)", ["2: deepspeed.comm.all_to_all_single"]),
    ("from deepspeed import comm as dist\ndist.barrier()", ["2: deepspeed.comm.barrier"]),
    ("from deepspeed import comm\ncomm.broadcast(t, 0)", ["2: deepspeed.comm.broadcast"]),
    ("from deepspeed.comm import all_gather_into_tensor\n",
     ["1: deepspeed.comm.all_gather_into_tensor (imported)"]),
])
def test_scanner_catches_each_form(source, expected):
    assert direct_collectives(source) == expected


@pytest.mark.parametrize("source", [
    "from lightning_zeromoe import collectives\ncollectives.all_reduce(t)\ncollectives.barrier()",
    "from lightning_zeromoe.engine.collectives import all_reduce, barrier\nall_reduce(t)\nbarrier()",
    "import torch.distributed as dist\ndist.get_rank(); dist.new_group([0]); dist.ReduceOp.MIN; dist.is_initialized()",
    "param.all_gather()\nengine.broadcast(x)\nstrategy.barrier()",  # not torch's or DeepSpeed's functions
    "def barrier():\n    pass\nbarrier()",
    "import torch.distributed as dist\ndist.all_reduce = None",  # assigned, not used
])
def test_scanner_leaves_everything_else_alone(source):
    assert direct_collectives(source) == []


def test_no_module_but_collectives_calls_a_collective_itself():
    offenders = []
    for root in ("lightning_zeromoe", "troubleshooter"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel in ALLOWED:
                continue
            offenders += [f"{rel}:{hit}" for hit in direct_collectives(path.read_text(encoding="utf-8"))]
    assert offenders == [], ("call these through lightning_zeromoe.engine.collectives, which runs them on the "
                             "backend's device:\n" + "\n".join(offenders))
    # and the allowed module really is where they are
    assert direct_collectives((REPO / "lightning_zeromoe/engine/collectives.py").read_text(encoding="utf-8"))
