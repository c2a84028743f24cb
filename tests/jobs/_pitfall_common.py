"""Shared by the pitfall job scripts: the models that fall into each trap, real gather counters, a
2-rank launcher for raw DeepSpeed runs.

Nothing here fakes DeepSpeed: the counters wrap DeepSpeed's own entry points and count the calls
that really happen.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import socket
import subprocess
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM, capture_router_logits

#: The parameter PitfallLM's root forward reads from another module (a functional use).
FUNCTIONAL_PARAM = "layers.0.attn.out.weight"


class Sidecar(nn.Module):
    """Adds ``x @ W^T``; with ``cache_data`` it caches ``self.weight.data`` on first use and uses the
    cache from then on: the stale-copy trap (W never receives a gradient)."""

    def __init__(self, hidden: int, cache_data: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden) * 0.02)
        self.cache_data = cache_data
        self.cached: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cache_data:
            return x + F.linear(x, self.weight)
        if self.cached is None:
            self.cached = self.weight.data
        return x + F.linear(x, self.cached)


class Mover(nn.Module):
    """Calls ``.to``/``.half``/... on its child during forward, as some user code does.

    ``moves`` is a list of (method, args) tuples tried once per forward. Errors are recorded (with
    the type name) instead of propagating when ``catch`` is set, so one run can try several moves.
    """

    def __init__(self, hidden: int, moves: list[tuple[str, tuple]] | None = None, catch: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden, bias=False)
        nn.init.normal_(self.lin.weight, std=0.02)
        self.moves = moves or []
        self.catch = catch
        self.errors: dict[str, str] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for method, args in self.moves:
            key = f"{method}{args!r}"
            try:
                getattr(self.lin, method)(*args)  # the call site the guard must name
            except Exception as err:  # noqa: BLE001 - recorded for the test
                if not self.catch:
                    raise
                self.errors.setdefault(key, f"{type(err).__name__}: {err}")
        return x + self.lin(x)


class PitfallLM(TinyMoELM):
    """TinyMoELM plus the traps: (optionally tied) lm_head, a functional use of
    ``layers.0.attn.out.weight`` in the root's forward, a Sidecar and a Mover."""

    def __init__(self, config: TinyMoEConfig, *, functional: bool = True, cache_data: bool = False,
                 moves: list[tuple[str, tuple]] | None = None, catch: bool = True) -> None:
        super().__init__(config)
        self.functional = functional
        self.sidecar = Sidecar(config.hidden_size, cache_data)
        self.mover = Mover(config.hidden_size, moves, catch)

    def forward(self, input_ids: torch.Tensor):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        x = self.mover(self.sidecar(x))
        with capture_router_logits(self) as router_logits:
            for layer in self.layers:
                x = layer(x)
        h = self.norm(x)
        if self.functional:
            # A parameter owned by layers.0.attn.out, read in this module's forward.
            h = h + 0.1 * F.linear(h, self.layers[0].attn.out.weight)
        return self.lm_head(h), router_logits


# ------------------------------------------------------------------ counting real gathers


class GatherCounter:
    """Counts, per training step, what DeepSpeed's ZeRO-3 really does to gather parameters.

    * ``collective``: calls of the communication backend's all-gather
      (``deepspeed.comm.torch.TorchBackend.all_gather_into_tensor`` / ``all_gather``): every
      all-gather that goes on the wire.
    * ``sync_gather``: calls of ``partition_parameters.Init._all_gather`` with ``async_op=False``
      that gather something: ``param.all_gather()``, the blocking path DeepSpeed takes for a
      parameter it discovers in the middle of a forward.
    * ``on_demand``: parameters a module needed that were neither gathered nor in flight when its
      fetch began (``PartitionedParameterCoordinator.fetch_sub_module``), i.e. not prefetched.
    * ``auto_register``: DeepSpeed registering an external parameter by itself
      (``parameter_offload.register_external_parameter``).
    """

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> "GatherCounter":
        from deepspeed.comm.torch import TorchBackend
        from deepspeed.runtime.zero import parameter_offload, partition_parameters
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator, iter_params

        counts = self.counts

        def wrap(owner: Any, name: str, before: Any) -> None:
            original = getattr(owner, name)

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                before(*args, **kwargs)
                return original(*args, **kwargs)

            self._undo.append((owner, name, original))
            setattr(owner, name, wrapped)

        def collective(*_a: Any, **_k: Any) -> None:
            counts["collective"] += 1

        def sync_gather(_self: Any, params: Any, async_op: bool = False, hierarchy: Any = None) -> None:
            if not async_op and any(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params):
                counts["sync_gather"] += 1

        def fetch(coordinator: Any, module: nn.Module, forward: bool) -> None:
            inflight = coordinator._PartitionedParameterCoordinator__inflight_param_registry
            counts["on_demand"] += sum(1 for p in set(iter_params(module))
                                       if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p not in inflight)

        def register(_module: Any, _param: Any) -> None:
            counts["auto_register"] += 1

        wrap(TorchBackend, "all_gather_into_tensor", collective)
        wrap(TorchBackend, "all_gather", collective)
        wrap(partition_parameters.Init, "_all_gather", sync_gather)
        wrap(PartitionedParameterCoordinator, "fetch_sub_module", fetch)
        wrap(parameter_offload, "register_external_parameter", register)
        return self

    def take(self) -> dict[str, int]:
        """This step's counts (all four keys), and start the next step from zero."""
        out = {k: int(self.counts.get(k, 0)) for k in ("collective", "sync_gather", "on_demand", "auto_register")}
        self.counts.clear()
        return out

    def remove(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []


# ------------------------------------------------------------------ raw 2-rank launch


def launch_two_ranks_if_needed() -> None:
    """Run this script as 2 ranks with env-var rendezvous (gloo, DeepSpeed's CPU accelerator).

    Returns in a rank process (RANK set); in the launching process, starts both ranks, waits,
    and exits with the worst exit status.
    """
    if "RANK" in os.environ:
        # A rank stuck in a collective dumps its stack and exits instead of hanging the test.
        faulthandler.dump_traceback_later(float(os.environ.get("PITFALL_RANK_TIMEOUT", "240")), exit=True)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    codes = [p.wait(timeout=600) for p in procs]
    sys.exit(max(codes))
