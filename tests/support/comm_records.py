"""What ``tests/jobs/comm_ledger_job.py`` wrote, against :mod:`lightning_zeromoe.planner.comm`.

Shared by ``tests/test_comm_ledger.py`` (2 and 4 ranks, asserted) and ``benchmarks/comm_ledger.py``
(the README's table). Pure: reads the job's per-rank JSON records, imports no torch.
"""

from __future__ import annotations

from lightning_zeromoe.planner import ParamCounts
from lightning_zeromoe.planner.comm import CommShape, predict


def shape_of(record: dict, first_step: bool = False) -> CommShape:
    """The comm model's input for one run, from one rank's record."""
    m = record["model"]
    return CommShape(counts=ParamCounts(tuple(record["dense"]), tuple(record["expert"])), stage=record["stage"],
                     world=record["world"], ep_size=record["ep_size"], precision=record["precision"],
                     top_k=m["top_k"], hidden_size=m["hidden_size"], moe_layers=m["num_layers"],
                     num_experts=m["num_experts"], tokens_per_micro_batch=record["tokens_per_micro_batch"],
                     accumulation=record["accumulation"],
                     param_persistence_threshold=record["zero"].get("stage3_param_persistence_threshold", 0),
                     param_order=tuple((n, e, m) for n, e, m in record["order"]), lightning=record["lightning"],
                     max_reuse_distance=record["zero"].get("stage3_max_reuse_distance", 10**9),
                     prefetch_bucket_size=record["zero"].get("stage3_prefetch_bucket_size", 5 * 10**7),
                     first_step=first_step)


def mean_over_ranks(ranks: list[dict], index: int) -> dict[str, float]:
    """Bytes per ``collective/group`` cell of step ``index``, averaged over the ranks (the
    all-to-all's combine sends what the rank received, which depends on routing)."""
    cells: dict[str, float] = {}
    for rank in ranks:
        for key, value in rank["steps"][index]["bytes"].items():
            cells[key] = cells.get(key, 0.0) + value / len(ranks)
    return cells


def compare(ranks: list[dict], index: int) -> tuple[dict[str, float], dict[str, float]]:
    """(measured, predicted) bytes per cell of step ``index``."""
    measured = mean_over_ranks(ranks, index)
    predicted = {f"{c}/{g}": v for (c, g), v in predict(shape_of(ranks[0], first_step=index == 0)).bytes.items()}
    return measured, predicted


def compare_calls(ranks: list[dict], index: int) -> tuple[dict[str, int], dict[str, int]]:
    """(measured, predicted) collective calls per cell of step ``index`` on rank 0 (every rank
    makes the same calls), the step-time model's latency term."""
    from lightning_zeromoe.planner.calls import calls_per_step

    shape = shape_of(ranks[0], first_step=index == 0)
    predicted = {f"{c}/{g}": n for (c, g), n in calls_per_step(shape, predict(shape)).items() if n}
    return {k: n for k, n in ranks[0]["steps"][index]["calls"].items() if n}, predicted


def worst_cell(measured: dict[str, float], predicted: dict[str, float]) -> tuple[str, float]:
    """The cell with the largest relative error, and that error."""
    errors = {key: abs(predicted.get(key, 0.0) - measured.get(key, 0.0)) / max(measured.get(key, 0.0), 1e-12)
              for key in set(measured) | set(predicted)}
    key = max(errors, key=errors.__getitem__)
    return key, errors[key]
