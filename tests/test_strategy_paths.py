"""The paths a fine-tuning job takes beyond fp32 ZeRO-3 fit, each against a plain single-process run.

One torchrun launch (2 CPU ranks, gloo, real DeepSpeed engines) runs every path of
``tests/jobs/strategy_paths.py`` in turn; a second launch runs two one-process "nodes". Each path's
reference is a plain PyTorch loop (no DeepSpeed, no Lightning) over the very batches the ranks
recorded, with the same seed, optimizer, schedule, accumulation and clipping.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from troubleshooter import knowledge
from support.jobs import JOBS, free_port, job_env, read_ranks, run_job
from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoELM, lm_losses

STEPS, BATCH, LR, WARMUP, CLIP = 6, 4, 3e-3, 3, 0.05
RUNS = ("s2_sched", "auto", "accum_clip", "bf16_true", "bf16_mixed", "s3_val", "native_s1", "native_s2", "grouped")
#: fp32: measured max relative difference ~2e-7 (summation order in the experts); the repo's parity bound.
RTOL = 2e-6
#: bf16 against the fp32 reference over 6 steps: measured max relative difference 1.4e-4 for both
#: bf16-true and bf16-mixed (DeepSpeed runs both as bf16 parameters with fp32 master weights; the
#: loss is computed from fp32 logits). A wrong path (unscaled loss, skipped step) is off by more,
#: and the dtype check catches "fp32 silently".
BF16_RTOL = 1e-3


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    out = tmp_path_factory.mktemp("paths")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    run_job("strategy_paths.py", "--out", str(out), "--runs", ",".join(RUNS), "--steps", str(STEPS),
            launcher=launcher, timeout=900)
    return {name: read_ranks(out / name, 2) for name in RUNS} | {"_dir": out}


def micro_batches(ranks: list[dict]) -> list[list[int]]:
    """Each recorded micro-step's global batch: rank 0's samples, then rank 1's."""
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"])
    return [a["indices"] + b["indices"] for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]


def dist_losses(ranks: list[dict]) -> list[float]:
    return [(a["loss"] + b["loss"]) / 2 for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]


def reference(batches: list[list[int]], *, accumulate: int = 1, clip: float | None = None,
              scheduler: bool = False, samples: int | None = None) -> tuple[list[float], TinyMoELM]:
    """Plain loop: seed 0, AdamW, per micro-step loss; accumulate, clip by global norm, step.

    ``samples``: the job's dataset size (default: one epoch of ``batches``)."""
    torch.manual_seed(0)
    config = TinyMoEConfig()
    model = TinyMoELM(config)
    data = SyntheticLMData(samples or len(batches) * BATCH * 2, config.max_seq_len // 2 + 1, config.vocab_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP)) if scheduler else None
    losses = []
    for i, indices in enumerate(batches):
        task, aux = lm_losses(model, data.tokens[indices])
        loss = (task + config.aux_loss_weight * aux).mean()
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            if sched is not None:
                sched.step()
    return losses, model


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name, stage", [("s2_sched", 2), ("auto", 1)])
def test_stage_1_and_2_split_the_users_optimizer_and_match_single_process(paths, name, stage):
    """torch AdamW from configure_optimizers (plus a LambdaLR warm-up at stage 2) under ZeRO-1/2 + EP=2."""
    ranks = paths[name]
    assert [r["stage"] for r in ranks] == [stage, stage]
    for r in ranks:
        assert r["expert_parallel"]
        assert sorted(g["moe"] for g in r["groups"]) == [False, True], r["groups"]
        assert [g["name"] for g in r["groups"] if g["moe"]] == ["ep_size_2"]
    ref, _ = reference(micro_batches(ranks), scheduler=name == "s2_sched")
    assert max_rel(dist_losses(ranks), ref) < RTOL
    if name == "s2_sched":
        # The warm-up drives every group, the split-off MoE group included (it inherits its origin's lambda).
        assert [round(s["lr"], 9) for s in ranks[0]["steps"][:3]] == [round(LR * min(1, (k + 2) / WARMUP), 9)
                                                                      for k in range(3)]


def test_accumulation_and_clipping_match_single_process(paths):
    ranks = paths["accum_clip"]
    assert len(ranks[0]["steps"]) == 2 * STEPS
    ref, _ = reference(micro_batches(ranks), accumulate=2, clip=CLIP)
    assert max_rel(dist_losses(ranks), ref) < RTOL
    unclipped, _ = reference(micro_batches(ranks), accumulate=2)
    assert max_rel(dist_losses(ranks), unclipped) > 100 * RTOL, "clipping should change the trajectory"


@pytest.mark.parametrize("name", ["bf16_true", "bf16_mixed"])
def test_bf16_trains_in_bf16_close_to_fp32(paths, name):
    ranks = paths[name]
    for r in ranks:
        assert r["dtypes"] == ["torch.bfloat16"], f"{name}: the engine's parameters should be bf16, got {r['dtypes']}"
    losses = dist_losses(ranks)
    assert all(torch.isfinite(torch.tensor(losses)))
    ref, _ = reference(micro_batches(ranks))
    assert max_rel(losses, ref) < BF16_RTOL, (losses, ref)
    assert losses[-1] < losses[0], "the loss should fall"


def _plain_val_losses(model: TinyMoELM, records: list[dict]) -> list[float]:
    config = model.config
    data = SyntheticLMData(16, config.max_seq_len // 2 + 1, config.vocab_size, seed=0)
    with torch.no_grad():
        out = []
        for rec in records:
            task, aux = lm_losses(model, data.tokens[rec["indices"]])
            out.append((task + config.aux_loss_weight * aux).mean().item())
    return out


def test_validate_after_fit_and_from_checkpoint_equal_a_plain_eval(paths):
    """validate(), test() and predict() after fit, and validate(ckpt_path=...) in a fresh Trainer with
    other initial weights, give the loss a plain eval of the same trained weights gives on the same batches."""
    ranks = paths["s3_val"]
    _, trained = reference(micro_batches(ranks))
    trained.eval()
    for r in ranks:
        assert r["val_after_fit"] and len(r["val_after_fit"]) == len(r["val_from_ckpt"])
        plain = _plain_val_losses(trained, r["val_after_fit"])
        assert max_rel([v["loss"] for v in r["val_after_fit"]], plain) < RTOL * 5
        assert [v["indices"] for v in r["val_from_ckpt"]] == [v["indices"] for v in r["val_after_fit"]]
        # test and predict take the same evaluation path: same batches, same losses.
        for other in ("test_after_fit", "predict_after_fit"):
            assert [v["indices"] for v in r[other]] == [v["indices"] for v in r["val_after_fit"]], other
            assert max_rel([v["loss"] for v in r[other]], plain) < RTOL * 5, other
        assert max_rel([v["loss"] for v in r["val_from_ckpt"]], plain) < RTOL * 5
        # Saving from the evaluation engine is refused with the entry id, not an AttributeError.
        assert r["save_after_eval"].startswith("[save-after-evaluation] "), r["save_after_eval"]
        assert knowledge.match(r["save_after_eval"])[0].entry.id == "save-after-evaluation"


#: Native MoE (fp32) against plain PyTorch: measured max |loss diff| 4.8e-7 over 6 steps, losses ~5.0, so
#: max relative 9.6e-8 (one fp32 ulp at 5.0 is 4.8e-7): the same products summed in another order
#: (DeepSpeed's dispatch/combine einsums and capacity-padded [E, C, H] expert buffers vs. row gathers).
#: Measured on the same recorded batches, each wrong variant of the reference is off by far more:
#: experts placed on the other rank 1.7e-3 (4.6e-4 at step 0), no aux loss 2.2e-3, twice the
#: gradient (lr x2) 2.8e-2. The repo's bound 2e-6 sits 20x above the noise and 200x below those.
NATIVE_RTOL = RTOL


@functools.lru_cache(maxsize=1)
def _native_job():
    """tests/jobs/native_moe.py, whose PlainMoELM is the reference (loaded once; it imports no DeepSpeed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("native_moe_job", JOBS / "native_moe.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def _native_reference(ranks: list[dict]) -> list[float]:
    return _native_job().plain_reference(ranks, STEPS, LR)


@pytest.mark.parametrize("name", ["native_s1", "native_s2"])
def test_native_deepspeed_moe_ep2_matches_plain_pytorch(paths, name):
    """MoE(ep_size=2) layers on 2 ranks: native_s2 under ZeroMoEStrategy(ep_size=2, stage=2), native_s1
    under stage="auto" with ep_size unset (the layers' size taken; the planner picks stage 1, never the
    stage 3 native layers cannot run). No AutoEP section, DeepSpeed's own
    ep_size_2 expert group, 2 of 4 experts per rank, and the losses of a plain single-process loop."""
    ranks = paths[name]
    assert [r["stage"] for r in ranks] == [int(name[-1])] * 2
    for r in ranks:
        assert [g["name"] for g in r["groups"] if g["moe"]] == ["ep_size_2"], r["groups"]
        assert not r["has_expert_parallel_section"] and r["strategy_ep_size"] == 2
        assert r["ep_size_given"] == (name == "native_s2")
        assert r["native_local_experts"] == {"model.moe": 2}
    ref = _native_reference(ranks)
    got = dist_losses(ranks)
    print(f"{name}: max |loss diff| vs plain PyTorch {max(abs(a - b) for a, b in zip(got, ref)):.2e} "
          f"over {len(ref)} steps; losses {got}")
    assert max_rel(got, ref) < NATIVE_RTOL


def test_two_nodes_of_one_process_each_match_single_process(tmp_path):
    """Two torchrun invocations (--nnodes 2, one process each) rendezvous on 127.0.0.1; the Trainer
    is built with num_nodes=2, devices=1."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
               str(JOBS / "strategy_paths.py"), "--out", str(tmp_path), "--runs", "nodes", "--steps", str(STEPS),
               "--devices", "1", "--num-nodes", "2"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=job_env()))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=600)[0])
        finally:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    ranks = read_ranks(tmp_path / "nodes", 2)
    assert [r["world_size"] for r in ranks] == [2, 2]
    ref, _ = reference(micro_batches(ranks))
    assert max_rel(dist_losses(ranks), ref) < RTOL


def test_grouped_experts_without_ep_match_single_process_and_save_export_resume(paths, tmp_path):
    """ZeroMoEStrategy(ep_size=1, grouped_experts=True) on 2 ranks: every block is AutoEP's layer with
    ep_size 1 holding all 4 experts (ZeRO-3 still shards them over both ranks), each step's loss is the
    plain loop's; its checkpoint exports to the model's own names with the plain loop's weights, and a
    fresh Trainer with other initial weights resumes from it onto the same trajectory."""
    from lightning_zeromoe.checkpoint import export

    ranks = paths["grouped"]
    for r in ranks:
        assert r["expert_parallel"] and r["stage"] == 3
        assert r["autoep_layers"] == {f"model.layers.{i}.mlp": {"ep_size": 1, "local_experts": 4} for i in (0, 1)}
        assert r["resumed_layers"] == r["autoep_layers"]
        for name, (local, shape) in r["held"].items():
            assert shape[0] == 4 and local < torch.Size(shape).numel(), (name, local, shape)
    samples = BATCH * 2 * STEPS
    ref, trained = reference(micro_batches(ranks), samples=samples)
    assert max_rel(dist_losses(ranks), ref) < RTOL
    # Export: AutoEP's names mapped back to the model's own, the plain loop's weights after STEPS steps.
    from safetensors.torch import load_file

    exported = load_file(str(export(ranks[0]["ckpt"], tmp_path / "grouped.safetensors", progress=False)))
    want = trained.state_dict()
    assert set(exported) == set(want), set(exported) ^ set(want)
    worst = max(float((exported[k].float() - want[k]).abs().max()) for k in want)
    assert worst < 1e-5, worst
    # Resume: the first STEPS batches, then the resumed run's two, are one plain trajectory.
    resumed = [{"steps": r["resumed_steps"]} for r in ranks]
    assert [s["step"] for s in resumed[0]["steps"]] == [STEPS + 1, STEPS + 2]
    batches = micro_batches(ranks) + micro_batches(resumed)
    ref_all, _ = reference(batches, samples=samples)
    assert max_rel(dist_losses(ranks) + dist_losses(resumed), ref_all) < RTOL
