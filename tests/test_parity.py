"""ZeRO-3 + EP=2 on 2 CPU ranks computes what a plain single-process run computes.

One 2-rank training run (a real Lightning launch, real DeepSpeed engines, gloo) is shared by the
parity, sharding and resume tests; the reference is a plain PyTorch loop over the very batches
each rank recorded.
"""

from __future__ import annotations

import math

import pytest
import torch

from support.jobs import read_ranks, run_job
from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoELM, lm_losses

STEPS, EPOCH_STEPS, BATCH, LR = 20, 10, 4, 3e-3
#: fp32 everywhere; measured max relative difference 2.0e-7 over 20 steps (summation order in the experts).
RTOL = 2e-6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    run_job("train_tiny.py", "--out", str(out), "--steps", str(STEPS), "--epoch-steps", str(EPOCH_STEPS),
            "--batch-size", str(BATCH), "--ckpt-every", str(EPOCH_STEPS), "--ckpt-dir", str(out / "ckpt"))
    ranks = read_ranks(out, 2)
    ranks[0]["ckpt_dir"] = out / "ckpt"
    return ranks


def global_batches(ranks: list[dict]) -> list[list[int]]:
    """Step k's global batch: rank 0's samples, then rank 1's, as each rank recorded them."""
    assert [len(r["steps"]) for r in ranks] == [STEPS, STEPS]
    return [ranks[0]["steps"][k]["indices"] + ranks[1]["steps"][k]["indices"] for k in range(STEPS)]


def reference_losses(batches: list[list[int]], aux_weight: float = 0.01) -> list[float]:
    """Single process, no DeepSpeed, no Lightning: same seed, same global batches, AdamW."""
    torch.manual_seed(0)
    config = TinyMoEConfig(aux_loss_weight=aux_weight)
    model = TinyMoELM(config)
    data = SyntheticLMData(BATCH * 2 * EPOCH_STEPS, config.max_seq_len // 2 + 1, config.vocab_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for indices in batches:
        task, aux = lm_losses(model, data.tokens[indices])
        loss = (task + aux_weight * aux).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_every_step_loss_matches_single_process(uninterrupted):
    """The mean of the two ranks' losses equals the single-process loss on the same global batch."""
    batches = global_batches(uninterrupted)
    assert all(len(set(b)) == 2 * BATCH for b in batches), "a sample appeared twice in one global batch"
    ds = [(a["loss"] + b["loss"]) / 2 for a, b in zip(uninterrupted[0]["steps"], uninterrupted[1]["steps"])]
    ref = reference_losses(batches)
    rel = [abs(x - y) / abs(y) for x, y in zip(ds, ref)]
    assert max(rel) < RTOL, f"max relative loss difference {max(rel):.2e} (per step: {rel})"
    assert ds[-1] < ds[0] - 0.5, "the loss should fall over 20 steps"


def test_experts_are_split_and_dense_params_partitioned(uninterrupted):
    """What each rank actually holds, read from its engine's parameters (not from the config)."""
    torch.manual_seed(0)
    initial = TinyMoELM(TinyMoEConfig())
    ffn = initial.config.ffn_hidden_size
    owned = []
    for rank in uninterrupted:
        held = rank["held"]
        experts = {n: h for n, h in held.items() if ".experts." in n}
        dense = {n: h for n, h in held.items() if ".experts." not in n}
        assert len(experts) == 6, experts.keys()  # 2 layers x (w1, w2, w3)
        for name, h in experts.items():
            assert h["ds_shape"][0] == 2, f"{name}: each rank should own 4 / ep_size=2 experts"
            assert h["local_numel"] == math.prod(h["ds_shape"])
        for name, h in dense.items():
            full = math.prod(h["ds_shape"])
            assert h["local_numel"] == math.ceil(full / 2), f"{name}: ZeRO-3 should hold half of {full}"
        owned.append(experts["model.layers.0.mlp.experts.w1"]["local_experts"])
        # The expert weights this rank holds are the initial model's gate halves of its own experts.
        local = owned[-1]
        want = initial.layers[0].mlp.experts.gate_up_proj[local, :ffn].double().sum().item()
        assert experts["model.layers.0.mlp.experts.w1"]["local_sum"] == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert sorted(owned[0] + owned[1]) == [0, 1, 2, 3] and set(owned[0]).isdisjoint(owned[1])


def test_resume_continues_exactly(uninterrupted, tmp_path):
    """ModelCheckpoint saved step 10 during the uninterrupted run; a new launch resumes from it and
    its steps 11-20 see the same batches and give the same losses."""
    ckpt = uninterrupted[0]["ckpt_dir"] / f"step={EPOCH_STEPS}.ckpt"
    assert (ckpt / "checkpoint").is_dir(), f"no ZeRO checkpoint shards in {ckpt}"
    run_job("train_tiny.py", "--out", str(tmp_path / "resumed"), "--steps", str(STEPS), "--resume", str(ckpt),
            "--epoch-steps", str(EPOCH_STEPS), "--batch-size", str(BATCH))
    resumed = read_ranks(tmp_path / "resumed", 2)
    for rank in (0, 1):
        tail = uninterrupted[rank]["steps"][EPOCH_STEPS:]
        got = resumed[rank]["steps"]
        assert [s["step"] for s in got] == [s["step"] for s in tail]
        assert [s["indices"] for s in got] == [s["indices"] for s in tail], "the resumed run saw other batches"
        for a, b in zip(got, tail):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
