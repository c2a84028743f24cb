"""The communication ledger and the communication model, against each other, on real training.

* One 2-rank launch (``tests/jobs/comm_ledger_job.py``) trains every ZeRO stage x ep_size 1, 2 for
  three optimizer steps on raw DeepSpeed engines (the strategy's config) with the ledger installed,
  two of them with gradient accumulation, one in bf16, one with ZeRO-3 re-gathering in backward,
  and one real ``Trainer.fit`` with ``ZeroMoEStrategy(comm_stats=True)`` and a CSVLogger; one
  4-rank launch trains ZeRO-1 and ZeRO-3 at ep_size 1, 2 and 4 (expert-data-parallel groups of
  2 and 1). The model (:mod:`lightning_zeromoe.planner.comm`) must predict every (collective,
  group) cell of the last step within 5% (measured: exactly), averaged over ranks (the
  all-to-all's combine sends what the rank received, which depends on routing; over all ranks it
  is ``T * k`` rows each way), and the step-time model's latency term exactly as many calls per
  cell as the ledger counted (ZeRO-3's coalesced prefetch gathers, its reductions split where
  the gradients' group changes).
* The byte definitions per ``torch.distributed`` function, checked in one process on a one-rank
  gloo group with tensors of known sizes, and what the ledger restores after a fit that raises.
"""

from __future__ import annotations

import sys

import pytest

from support.comm_records import compare, compare_calls
from support.jobs import free_port, read_ranks, run_job

#: Every stage x ep_size; accumulation at stages 1 (one reduction per step) and 3; ZeRO-3 with a
#: reuse distance of 1e5 elements and no prefetch (a backward re-gather of the first layers); bf16.
RAW = ("s1e1", "s2e1", "s3e1", "s1e2", "s2e2", "s3e2", "s1e2a2", "s3e2a2", "s3e1r100000p0", "s3e2b")
LIGHTNING = ("s3e2",)
TOLERANCE = 0.05


#: On 4 ranks: expert-data-parallel groups of 2 (``e2``: experts gathered and reduced over them, in
#: calls of their own) and of 1 (``e4``), ZeRO-1 and ZeRO-3; raw engines only (one launch, ~30 s).
RAW_4 = ("s3e1", "s1e2", "s3e2", "s1e4", "s3e4")


def _launch(out, world: int, raw: tuple[str, ...], lightning: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                str(free_port())]
    run_job("comm_ledger_job.py", "--out", str(out), "--raw", ",".join(raw), "--runs", ",".join(lightning),
            launcher=launcher, timeout=900)
    found = {f"raw_{n}": read_ranks(out / f"raw_{n}", world) for n in raw}
    return found | {n: read_ranks(out / n, world) for n in lightning}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("comm"), 2, RAW, LIGHTNING)


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("comm4"), 4, RAW_4)


#: The step compared: the last of three (ZeRO-3 records its trace on the first and checks it on the
#: second); the Lightning fit runs a fourth, which holds the expert monitor's own all-reduce.
COMPARED = 2


def _check_every_cell(runs: dict[str, list[dict]]) -> None:
    """Bytes within 5% (measured: exactly), and as many calls (the step-time model's latency term)."""
    table = ["| run | ranks | stage | ep | accum | measured MB/step | predicted MB/step | predicted / measured |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ranks in runs.items():
        measured, predicted = compare(ranks, COMPARED)
        for key in sorted(set(measured) | set(predicted)):
            got, want = measured.get(key, 0.0), predicted.get(key, 0.0)
            assert want == pytest.approx(got, rel=TOLERANCE), (name, key, got, want)
        calls, predicted_calls = compare_calls(ranks, COMPARED)
        assert calls == predicted_calls, (name, calls, predicted_calls)
        total_m, total_p = sum(measured.values()), sum(predicted.values())
        r = ranks[0]
        table.append(f"| {name} | {r['world']} | {r['stage']} | {r['ep_size']} | {r['accumulation']} | "
                     f"{total_m / 1e6:.4f} | {total_p / 1e6:.4f} | {total_p / total_m:.4f} |")
    print("\n".join(table))


def test_model_predicts_every_cell_of_the_ledger(runs):
    _check_every_cell(runs)


def test_model_predicts_every_cell_of_the_ledger_on_4_ranks(runs_4):
    _check_every_cell(runs_4)


def test_the_first_zero3_step_gathers_again_in_backward(runs):
    """The trace is recorded on the first step: every parameter is gathered in forward and again in
    backward; later steps keep the tiny model's parameters from forward to backward."""
    for name in ("raw_s3e1", "raw_s3e2", "raw_s3e2a2"):
        last, _ = compare(runs[name], COMPARED)
        first, predicted = compare(runs[name], 0)
        assert sum(predicted.values()) == pytest.approx(sum(first.values()), rel=TOLERANCE), name
        accum = runs[name][0]["accumulation"]
        assert first["all_gather/world"] == pytest.approx(last["all_gather/world"] * (accum + 1) / accum), name


def test_groups_are_told_apart_and_ranks_agree(runs):
    for name, ranks in runs.items():
        ep = ranks[0]["ep_size"]
        groups = {key.split("/")[1] for rank in ranks for step in rank["steps"] for key in step["bytes"]}
        assert groups == ({"world", "expert_parallel", "expert_data_parallel"} if ep > 1 else {"world"}), name
        for index in range(COMPARED + 1):  # every collective but the all-to-all moves the same bytes on each rank
            cells = [{k: v for k, v in r["steps"][index]["bytes"].items() if not k.startswith("all_to_all")}
                     for r in ranks]
            assert cells[0] == cells[1], (name, index, cells)
        for rank in ranks:
            assert rank["restored"], name
            sizes = rank["steps"][-1]["group_sizes"]
            assert sizes.get("all_to_all/expert_parallel", ep) == ep  # EP=2 on 2 ranks: one group of both
            if ep > 1:
                assert {v for k, v in sizes.items() if k.endswith("/expert_data_parallel")} == {1}


def test_lightning_fit_logs_the_ledger_and_restores_torch(runs):
    ranks = runs["s3e2"]
    assert all(r["restored"] and r["error"] is None for r in ranks)
    logged = ranks[0]["logged"]
    assert [int(row["step"]) for row in logged] == [s["step"] for s in ranks[0]["steps"]] == [1, 2, 3, 4]
    for row, step in zip(logged, ranks[0]["steps"]):
        for key, value in step["bytes"].items():
            assert float(row[f"comm/{key}_MB"]) == pytest.approx(value / 1e6)
        assert float(row["comm/total_MB"]) == pytest.approx(sum(step["bytes"].values()) / 1e6)
    # The expert monitor's window (3 steps) carries the ledger's mean per step beside the expert shares.
    (window,) = ranks[0]["monitor"]
    assert int(window["step"]) == 3 and any(k.endswith("/share_0") for k in window), window
    steps = ranks[0]["steps"][:3]
    assert float(window["experts/comm/total_MB"]) == pytest.approx(
        sum(sum(s["bytes"].values()) for s in steps) / len(steps) / 1e6)
    # Lightning's per-batch SIGTERM flag is the one collective a raw loop does not have.
    lightning, _ = compare(ranks, COMPARED)
    raw, _ = compare(runs["raw_s3e2"], COMPARED)
    assert lightning.pop("broadcast/world") == 8 and lightning == raw


# ------------------------------------------------------------------------------------ in process

def test_bytes_per_function_on_a_one_rank_group(tmp_path):
    """Each counted function with tensors of known sizes, through the real wrappers."""
    import torch
    import torch.distributed as dist

    from lightning_zeromoe.observe.comm_ledger import CommLedger

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    original = dist.all_reduce
    ledger = CommLedger()
    try:
        ledger.install()
        x = torch.zeros(10, dtype=torch.float32)  # 40 bytes
        dist.all_reduce(x)
        dist.broadcast(torch.zeros(3, dtype=torch.int64), src=0)  # 24
        dist.all_gather([torch.zeros(5, dtype=torch.bfloat16)], torch.zeros(5, dtype=torch.bfloat16))  # 10
        dist.all_gather_into_tensor(torch.zeros(6), torch.zeros(6))  # 24 (it calls all_gather_single: once)
        dist.all_to_all_single(torch.zeros(7), torch.zeros(7))  # 28
        dist.reduce(torch.zeros(2, dtype=torch.float64), dst=0)  # 16
        try:
            dist.reduce_scatter_tensor(torch.zeros(4), torch.zeros(4))  # 16, counted at the call
        except (RuntimeError, ValueError):
            pass  # gloo may not implement it; the call was made all the same
        step = ledger.close_step(1)
    finally:
        ledger.uninstall()
        dist.destroy_process_group()
    assert step.bytes == {("all_reduce", "world"): 40, ("broadcast", "world"): 24, ("all_gather", "world"): 34,
                          ("all_to_all", "world"): 28, ("reduce", "world"): 16, ("reduce_scatter", "world"): 16}
    assert step.calls[("all_gather", "world")] == 2
    assert not ledger.installed and dist.all_reduce is original


def test_counting_outside_lightning_records_steps_and_restores_on_exit(tmp_path):
    """The standalone use (another training loop, the HF Trainer in benchmarks/peer_compare.py):
    ``with ledger.counting():``, ``begin()`` once the engine exists, ``close_step()`` per step."""
    import torch
    import torch.distributed as dist

    from lightning_zeromoe import CommLedger

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    original = dist.all_reduce
    ledger = CommLedger()
    try:
        with pytest.raises(RuntimeError, match="planned"), ledger.counting() as counting:
            assert counting is ledger and ledger.installed and dist.all_reduce is not original
            dist.broadcast(torch.zeros(4), src=0)  # engine set-up: 16 bytes, before begin()
            ledger.begin(0)
            dist.all_reduce(torch.zeros(10))  # step 1: 40 bytes
            ledger.close_step(1)
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))  # step 2: 16 bytes
            ledger.close_step(2)
            raise RuntimeError("planned")
        assert not ledger.installed and dist.all_reduce is original
        dist.all_reduce(torch.zeros(3))  # after the block: not counted
    finally:
        ledger.uninstall()
        dist.destroy_process_group()
    assert ledger.setup_comm.bytes == {("broadcast", "world"): 16}
    assert [(s.step, s.bytes) for s in ledger.steps] == [(1, {("all_reduce", "world"): 40}),
                                                           (2, {("all_reduce", "world"): 16})]


def test_a_fit_that_raises_restores_torch_distributed():
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
    from lightning_zeromoe.observe.comm_ledger import COUNTED, CommLedger

    class Fails(TinyMoEModule):
        def training_step(self, batch, batch_idx):
            raise RuntimeError(f"planned, wrapped={dist.all_reduce is not before[('torch.distributed', 'all_reduce')]}")

    before = {(o.__name__, n): getattr(o, n) for o in (dist, c10d) for n in COUNTED}
    ledger = CommLedger()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[ledger])
    with pytest.raises(RuntimeError, match="planned, wrapped=True"):
        trainer.fit(Fails(TinyMoEConfig(), batch_size=2, num_samples=8))
    assert not ledger.installed
    assert all(getattr(o, n) is before[(o.__name__, n)] for o in (dist, c10d) for n in COUNTED)
    assert torch.distributed.all_reduce is before[("torch.distributed", "all_reduce")]


def test_comm_stats_keyword_installs_one_ledger():
    from lightning_zeromoe import ZeroMoEStrategy
    from lightning_zeromoe.observe.comm_ledger import CommLedger

    assert isinstance(ZeroMoEStrategy(comm_stats=True).comm_ledger, CommLedger)
    assert ZeroMoEStrategy().comm_ledger is None
