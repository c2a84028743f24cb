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
#: per direction. Latency: inter-node NCCL calls of small messages take a few tens of us. This is the
#: bus bandwidth of a group with one rank per node; a group with ``k`` ranks on each node gets ``k``
#: times it (:func:`spanning_link`).
INFINIBAND = Link(bandwidth=50e9, latency=30e-6)

#: Collectives NCCL runs as rings or trees over its channels (``nccl-tests``' bus bandwidth applies).
RING_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


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


def ranks_per_node(group: str, world: int, ep_size: int, gpus_per_node: int) -> int:
    """Ranks of one group of that name on each node it touches (the fewest, over its nodes)."""
    ranks = group_ranks(group, world, ep_size)[0]
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    return min(nodes.values())


def spanning_link(collective: str, per_node: int, intra: Link, inter: Link) -> Link:
    """The link of a collective whose group spans nodes with ``per_node`` ranks on each.

    NCCL runs a ring or tree collective over several channels, one per NIC of the node, so the data
    that crosses nodes leaves through every NIC the group's ranks own: ``per_node`` HCAs at
    ``inter.bandwidth`` each (the rail-optimised DGX / p5 design, one per GPU), and the bus bandwidth
    is that sum, at most the NVLink inside the node. (Not measured here: the published 2 x 8 H100 run
    in ``tests/fixtures/published_step_times.toml`` is consistent with ~8 x 50 GB/s for ZeRO-3's world
    group and far from 50 GB/s.) A group with one rank per node (expert-data-parallel groups, strided)
    has one NIC per rank: ``inter.bandwidth``. All-to-all sends each rank's off-node
    rows through its own NIC, so it stays at ``inter.bandwidth``."""
    if collective in RING_COLLECTIVES and per_node > 1:
        return Link(min(intra.bandwidth, inter.bandwidth * per_node), inter.latency)
    return inter


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


__all__ = ["INFINIBAND", "NVLINK", "RING_COLLECTIVES", "Link", "bus_factor", "group_ranks", "group_size",
           "ranks_per_node", "spanning_link", "spans_nodes"]
