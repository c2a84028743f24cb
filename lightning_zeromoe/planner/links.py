"""Links and where the collectives' groups sit: the bus bandwidth and latency of a link, the
``nccl-tests`` bus factor per collective, and DeepSpeed's placement of the expert groups on nodes
(for :mod:`lightning_zeromoe.planner.step_time`). Pure module: no torch import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One kind of link: bus bandwidth (bytes/s, the ``nccl-tests`` busbw) and latency per call (s)."""

    bandwidth: float
    latency: float


#: NVLink 4 (H100/H200 SXM): 900 GB/s per GPU both directions together, 450 GB/s each way (NVIDIA
#: H100 and H200 datasheets). NCCL all-reduce bus bandwidth on 8 x H100 SXM reaches about this in
#: ``nccl-tests`` at large sizes. Latency: small-message NCCL calls inside a node are ~10-20 us.
NVLINK = Link(bandwidth=450e9, latency=15e-6)
#: InfiniBand NDR, one 400 Gb/s HCA per GPU (DGX H100 / H200 reference design): 50 GB/s per GPU
#: per direction. Latency: inter-node NCCL calls of small messages take a few tens of us.
INFINIBAND = Link(bandwidth=50e9, latency=30e-6)


def group_ranks(group: str, world: int, ep_size: int) -> list[list[int]]:
    """Rank lists of each group of that name, as DeepSpeed builds them."""
    if group == "expert_parallel":
        return [list(range(i, i + ep_size)) for i in range(0, world, ep_size)]
    if group == "expert_data_parallel":
        return [list(range(j, world, ep_size)) for j in range(ep_size)]
    return [list(range(world))]


def spans_nodes(group: str, world: int, ep_size: int, gpus_per_node: int) -> bool:
    """Whether any group of that name has ranks on more than one node."""
    return any(len({r // gpus_per_node for r in ranks}) > 1 for ranks in group_ranks(group, world, ep_size))


def group_size(group: str, world: int, ep_size: int) -> int:
    """Ranks in each group of that name."""
    return len(group_ranks(group, world, ep_size)[0])


#: Bus-bandwidth factor per collective (nccl-tests' PERFORMANCE.md): busbw = algbw * factor.
def bus_factor(collective: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return 1.0
    return (n - 1) / n


__all__ = ["INFINIBAND", "NVLINK", "Link", "bus_factor", "group_ranks", "group_size", "spans_nodes"]
