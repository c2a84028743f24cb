"""``from_pretrained`` inside ``configure_model`` under ZeRO-3 + EP=2, on 2 real CPU ranks.

One launch (``tests/jobs/pretrained_job.py``): a Mixtral saved with ``save_pretrained`` is loaded
in ``configure_model``, trained 3 optimizer steps of 2 accumulated micro-batches with a gradient
audit of 2 steps. Checked against a plain single-process loop over the batches each rank
recorded, starting from the same ``from_pretrained`` weights:

* the first micro-batch's loss equals the pretrained model's loss on that batch (the weights were
  loaded, not initialised), and every later micro-batch matches the plain run;
* each rank held only its ZeRO-3 partition of every parameter right after loading, and never
  copied more than one partition's worth of any tensor;
* the gradient audit counted optimizer steps (2), not micro-batches (4).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from support.jobs import read_ranks, run_job
from support.pretrained import SEQ_LEN, build_tiny_mixtral, lm_loss, plain_reference
from lightning_zeromoe.reference.models import SyntheticLMData

STEPS, ACCUMULATE, BATCH, AUDIT = 3, 2, 2, 2
#: fp32 on both sides; the remaining difference is summation order in the experts and the all-reduce.
RTOL = 2e-5


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    build_tiny_mixtral().save_pretrained(root / "mixtral")
    run_job("pretrained_job.py", "--pretrained", str(root / "mixtral"), "--out", str(root / "out"),
            "--steps", str(STEPS), "--accumulate", str(ACCUMULATE), "--batch-size", str(BATCH),
            "--audit-steps", str(AUDIT), timeout=400)
    return root / "mixtral", read_ranks(root / "out", 2)


def reference(path: Path, ranks: list[dict]) -> list[list[float]]:
    return plain_reference(path, ranks, steps=STEPS, accumulate=ACCUMULATE, batch=BATCH)


def test_first_loss_is_the_pretrained_models_and_every_step_matches(pretrained_run):
    path, ranks = pretrained_run
    assert [len(r["steps"]) for r in ranks] == [STEPS * ACCUMULATE] * 2
    assert all(r["global_step"] == STEPS for r in ranks)
    assert all(r["autoep_layers"] == [[4, 2, 2], [4, 2, 2]] for r in ranks), "AutoEP did not convert both blocks"
    ref = reference(path, ranks)
    # Step 1: the weights the strategy trained from are the saved ones.
    data = SyntheticLMData(BATCH * 2 * STEPS * ACCUMULATE, SEQ_LEN, 128, seed=0)
    first = data.tokens[ranks[0]["steps"][0]["indices"]]
    with torch.no_grad():
        fresh = lm_loss(build_tiny_mixtral(seed=1), first).item()
    assert ranks[0]["steps"][0]["loss"] == pytest.approx(ref[0][0], rel=1e-6)
    assert abs(fresh - ref[0][0]) > 1e-3, "the check could not tell loaded weights from a fresh init"
    for r in (0, 1):
        got = [s["loss"] for s in ranks[r]["steps"]]
        rel = [abs(a - b) / abs(b) for a, b in zip(got, ref[r])]
        assert max(rel) < RTOL, f"rank {r}: max relative difference {max(rel):.2e} per micro-batch {rel}"
    assert ref[0][-1] < ref[0][0], "the loss should fall"


def test_no_rank_held_the_whole_model_while_loading(pretrained_run):
    _, ranks = pretrained_run
    for r in ranks:
        load = r["load"]
        assert load["zero3_partitioned"], "from_pretrained built unpartitioned parameters"
        params = load["params"]
        total = sum(p["ds_numel"] for p in params.values())
        held = sum(p["partition"] for p in params.values())
        assert all(p["materialised"] == 0 for p in params.values()), "a parameter stayed gathered after loading"
        assert all(p["partition"] == math.ceil(p["ds_numel"] / 2) for p in params.values())
        assert held <= total / 2 + len(params), f"rank {r['rank']} holds {held} of {total} elements"
        biggest = max(p["ds_numel"] for p in params.values())
        assert load["largest_slice_copied"] <= math.ceil(biggest / 2), "a rank copied more than its partition"
        rows = load["expert_rows"]  # save_pretrained writes one tensor per expert; the model fuses them
        assert rows["total"] > 0, "no fused expert tensor was converted expert by expert"
        assert rows["converted"] == rows["total"] // 2, f"rank {r['rank']} fused other ranks' experts too: {rows}"


def test_gradient_audit_counts_optimizer_steps_not_micro_batches(pretrained_run):
    _, ranks = pretrained_run
    for r in ranks:
        assert r["audit"]["report_steps"] == AUDIT
        assert r["audit"]["optimizer_steps_counted"] == AUDIT
        # The report comes at the end of optimizer step AUDIT: micro-batch AUDIT * ACCUMULATE - 1.
        assert r["audit"]["reported_at_batch_idx"] == AUDIT * ACCUMULATE - 1
