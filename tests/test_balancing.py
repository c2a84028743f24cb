"""Load balancing that fixes: ExpertBiasBalancer (aux-loss-free, DeepSeek-V3's sign rule) and the
router z-loss, with and without expert parallelism.

* By hand: the sign rule and its centred (torchtitan) variant; the z-loss's value.
* Every Hugging Face MoE family of ``tests/support/hf_zoo.py`` (one process, no Trainer): the balancer finds
  each choice-only bias the model has (and nothing in families without one); the bias really
  steers the choice (+100 on one expert sends every token there) and only the choice (a change
  too small to change any choice leaves the output bit-identical); the counts it reads add up to
  tokens x top-k.
* Refusals, in one process with Lightning's default strategy: a model without the bias, a bias
  that requires grad.
* One 2-rank launch (``tests/jobs/balancing_job.py``, ZeroMoEStrategy, ZeRO-3): the tiny MoE with
  ``score_bias`` + aux loss + z-loss, ``ep_size=2`` vs ``ep_size=1`` vs a plain single-process run
  that applies the rule itself, step by step (bias after every update, every loss term); resume of
  the EP=2 checkpoint on EP=1 with other initial weights; the export's bias name; four Hugging Face
  families (the bias on the router, on the block, a frozen parameter ZeRO-3 partitions, a ZeRO-3
  fallback block) EP=2 vs EP=1 with the z-loss in the loss; a bias changed on one rank stops both.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from support.jobs import read_ranks, run_job
from lightning_zeromoe.balance.rules import bias_update, router_z_loss
from troubleshooter import knowledge

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
import balancing_job as J  # noqa: E402

#: Relative loss gap allowed between EP=2, EP=1 and the plain run (measured: at most 1.3e-7).
LOSS_RTOL = 2e-6


# --------------------------------------------------------------------------------------------- by hand

def test_sign_rule_and_its_centred_variant():
    counts = torch.tensor([10, 30, 20, 20])  # mean 20
    assert bias_update(counts, 0.01).tolist() == pytest.approx([0.01, -0.01, 0.0, 0.0])
    centred = bias_update(counts, 0.01, centered=True)
    assert float(centred.sum()) == pytest.approx(0.0, abs=1e-9) and centred.dtype == torch.float32
    # A constant shift of every bias changes no top-k choice: the two variants route alike.
    scores = torch.rand(64, 4, generator=torch.Generator().manual_seed(0))
    plain, shifted = scores + bias_update(counts, 0.01), scores + centred
    assert torch.equal(plain.topk(2).indices, shifted.topk(2).indices)


def test_router_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: log 2, log 4
    expected = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert float(router_z_loss(logits)) == pytest.approx(expected)
    # layers of different expert counts: the mean over every routed token of every layer
    other = torch.zeros(3, 4)  # logsumexp log 4
    both = float(router_z_loss((logits, other)))
    assert both == pytest.approx((math.log(2) ** 2 + 4 * math.log(4) ** 2) / 5)
    per_sequence = router_z_loss([logits], batch_size=2)
    assert per_sequence.tolist() == pytest.approx([math.log(2) ** 2, math.log(4) ** 2])
    with pytest.raises(ValueError, match="output_router_logits=True"):
        router_z_loss(())


# ------------------------------------------------------------------------------- every HF family

def _choices(sites, net, ids, calls: list[int] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Counts per site (through the balancer's own hooks) and the logits of one forward; ``calls``, if
    given, receives how often each site's module ran (a looped layer runs more than once)."""
    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer

    balancer = ExpertBiasBalancer()
    balancer.sites = sites
    balancer._counts = [None] * len(sites)
    ran = [0] * len(sites)

    def count_call(i):
        def hook(module, args, kwargs):
            ran[i] += 1
        return hook

    hooks = [s.counter.register_forward_pre_hook(balancer._experts_hook(i), with_kwargs=True)
             for i, s in enumerate(sites)]
    hooks += [s.counter.register_forward_pre_hook(count_call(i), with_kwargs=True) for i, s in enumerate(sites)]
    try:
        with torch.no_grad():
            logits = net(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    if calls is not None:
        calls[:] = ran
    return [torch.zeros(s.num_experts, dtype=torch.long) if c is None else c for s, c in zip(sites, balancer._counts)], logits


def test_every_family_with_a_choice_only_bias_is_found_and_it_steers_only_the_choice():
    from support.hf_zoo import ARCHS, build, tiny_config
    from lightning_zeromoe.balance.balancer import find_score_biases
    from lightning_zeromoe.discovery.structure import ROUTING_TENSOR_NAMES

    torch.set_num_threads(1)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with_bias = []
    for arch in ARCHS:
        net = build(arch)
        net.train()
        sites, _ = find_score_biases(net)
        named = {n for n, _ in [*net.named_parameters(), *net.named_buffers()]
                 if n.rsplit(".", 1)[-1] in ROUTING_TENSOR_NAMES}
        assert {s.name for s in sites} == named, arch  # every bias the model has, nothing else
        if not sites:
            continue
        with_bias.append(arch)
        config = tiny_config(arch)
        top_k = next(getattr(config, a) for a in ("num_experts_per_tok", "moe_k", "moe_topk") if hasattr(config, a))
        runs: list[int] = []
        counts, logits = _choices(sites, net, ids, runs)
        for site, c, n in zip(sites, counts, runs):  # n: 1, or more for a looped layer (inkling2_loop)
            assert n >= 1 and int(c.sum()) == ids.numel() * top_k * n, (arch, site.name, c, n)
        saved = [s.tensor.detach().clone() for s in sites]
        with torch.no_grad():
            for s in sites:
                s.tensor.view(-1)[1] += 100.0
        steered, _ = _choices(sites, net, ids)
        assert all(int(c[1]) == ids.numel() * n for c, n in zip(steered, runs)), (arch, steered)  # all pick expert 1
        with torch.no_grad():
            for s, v in zip(sites, saved):
                s.tensor.copy_(v)
                s.tensor.view(-1)[2] += 1e-7
        nudged, nudged_logits = _choices(sites, net, ids)
        assert [c.tolist() for c in nudged] == [c.tolist() for c in counts], arch  # no choice changed ...
        assert torch.equal(nudged_logits, logits), arch  # ... and then nothing else did: the bias is choice-only
    print(f"\n{len(with_bias)} of {len(ARCHS)} families have a choice-only bias: {' '.join(with_bias)}")
    assert {"deepseek_v3", "afmoe", "lfm2_moe", "laguna", "kolibri1", "ernie4_5_moe"} <= set(with_bias)
    assert "mixtral" not in with_bias and "qwen3_moe" not in with_bias


# ---------------------------------------------------------------------------------- refusals

def _fit_one_step(module, balancer) -> None:
    import lightning as L

    L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[balancer]).fit(module)


def test_a_model_without_a_choice_only_bias_is_refused_with_the_reason():
    from lightning_zeromoe.balance.balancer import REFUSED, BiasBalancingError, ExpertBiasBalancer
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

    with pytest.raises(BiasBalancingError) as err:
        _fit_one_step(TinyMoEModule(TinyMoEConfig(), batch_size=2, num_samples=4), ExpertBiasBalancer())
    message = str(err.value)
    assert err.value.entry_id == REFUSED and message.startswith(f"[{REFUSED}] ")
    assert "model.layers.0.mlp, model.layers.1.mlp" in message and "would change the model" in message
    assert knowledge.match(message)[0].entry.id == REFUSED
    # a bias the optimizer trains would be overwritten at every step: refused too
    module = TinyMoEModule(TinyMoEConfig(score_bias=True), batch_size=2, num_samples=4)
    for layer in module.model.layers:
        gate = layer.mlp.gate
        bias = gate.e_score_correction_bias
        del gate._buffers["e_score_correction_bias"]
        gate.e_score_correction_bias = torch.nn.Parameter(bias.clone())
    with pytest.raises(BiasBalancingError, match=r"requires_grad=True"):
        _fit_one_step(module, ExpertBiasBalancer())


def test_tiny_module_logs_the_z_loss_apart_and_adds_it():
    import lightning as L

    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

    L.seed_everything(0, verbose=False)
    module = TinyMoEModule(TinyMoEConfig(z_loss_weight=0.5, aux_loss_weight=0.01), batch_size=2, num_samples=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    got = module.last_losses
    assert {"train/task_loss", "train/aux_loss", "train/z_loss"} <= set(trainer.callback_metrics)
    assert got["loss"] == pytest.approx(got["task_loss"] + 0.01 * got["aux_loss"] + 0.5 * got["z_loss"], rel=1e-6)
    assert got["z_loss"] > 0


# ------------------------------------------------------------------------------ the 2-rank job

@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("balancing")
    proc = run_job("balancing_job.py", "--out", str(out), timeout=900)
    print("\n" + "\n".join(line for line in proc.stdout.splitlines() if line.startswith("[balancing]")))
    return read_ranks(out, 2)


def _case(ranks: list[dict], case: str) -> list[dict]:
    """Each rank's result of one case; a case that raised fails here with its error and traceback."""
    for rank in ranks:
        assert "error" not in rank[case] or case == "diverged", f"{case}: {rank[case]['error']}\n{rank[case].get('trace')}"
    return [rank[case] for rank in ranks]


def _max_gap(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k], strict=True))


def _assert_losses(got: dict, want: dict, keys=("task_loss", "aux_loss", "z_loss", "loss")) -> None:
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), key


def test_bias_and_losses_are_equal_with_ep_without_and_in_a_plain_run(job):
    ranks = job
    for case in ("tiny_ep2", "tiny_ep1"):
        _case(ranks, case)
    ref = ranks[0]["reference"]
    for case, kind, name in (("tiny_ep2", "autoep-router", "router"), ("tiny_ep1", "expert-indices", "gate")):
        result = ranks[0][case]
        assert [s[2] for s in result["sites"]] == [kind, kind], case
        assert result["sites"][0][1] == f"model.layers.0.mlp.{name}.e_score_correction_bias"
        assert result["updates"] == J.STEPS
        for step in range(J.STEPS):
            for rank in ranks:  # identical on every rank, and equal to the plain run's
                assert rank[case]["biases"][step] == ranks[0][case]["biases"][step]
            assert _max_gap(result["biases"][step], ref["biases"][step]) < 1e-7, (case, step)
            for r, rank in enumerate(ranks):
                record = rank[case]["records"][step]
                assert record["indices"] == ref["indices"][r][step]
                _assert_losses(record, ref["records"][r][step])
    # the rule really moved the biases (each entry by 0 or +-RATE per step), and routing with them
    first = ref["biases"][0]["model.layers.0.mlp"]
    assert all(abs(abs(b) - J.RATE) < 1e-7 or b == 0 for b in first) and any(b != 0 for b in first)


def test_resume_on_another_shape_keeps_the_bias_and_its_trajectory(job):
    """EP=2 saved after step 3, resumed on EP=1 with other initial weights: each later step equals the
    plain run over the same batches (bias and every loss term); the first resumed bias update
    starts from the saved bias, which a fresh model (zeros) would not."""
    ranks = job
    _case(ranks, "tiny_ep2")
    _case(ranks, "tiny_resume")
    ref = ranks[0]["reference_resumed"]
    saved = ranks[0]["tiny_ep2"]["biases"][J.SAVE_AT - 1]
    assert any(v != 0 for v in saved["model.layers.0.mlp"])
    resumed = ranks[0]["tiny_resume"]
    assert len(resumed["biases"]) == J.STEPS - J.SAVE_AT
    for i, step in enumerate(range(J.SAVE_AT, J.STEPS)):
        assert resumed["biases"][i] == ranks[1]["tiny_resume"]["biases"][i]
        assert _max_gap(resumed["biases"][i], ref["biases"][step]) < 1e-7, step
        for r, rank in enumerate(ranks):
            record = rank["tiny_resume"]["records"][i]
            assert record["indices"] == ref["indices"][r][step]
            _assert_losses(record, ref["records"][r][step])


def test_the_export_names_the_bias_as_the_model_does(job):
    exported = _case(job, "tiny_ep2")[0]["exported"]
    saved = job[0]["tiny_ep2"]["biases"][J.SAVE_AT - 1]
    assert sorted(exported) == ["layers.0.mlp.gate.e_score_correction_bias", "layers.1.mlp.gate.e_score_correction_bias"]
    for layer in (0, 1):
        assert exported[f"layers.{layer}.mlp.gate.e_score_correction_bias"] == saved[f"model.layers.{layer}.mlp"]


@pytest.mark.parametrize("family", J.HF)
def test_hf_family_balances_and_adds_the_z_loss_alike_with_and_without_ep(job, family):
    ranks = job
    ep2, ep1 = _case(ranks, f"{family}:2")[0], _case(ranks, f"{family}:1")[0]
    assert ep2["updates"] == ep1["updates"] == J.HF_STEPS
    assert [s[0] for s in ep2["sites"]] == [s[0] for s in ep1["sites"]] and ep2["sites"]
    if family == "kolibri1":  # a block AutoEP cannot take: the model's own block, also with ep_size=2
        assert ep2["fallback"] and not ep2["ep_blocks"] and ep2["sites"][0][2] == "expert-indices"
    else:  # AutoEP's router holds the bias under ep_size=2, the model's own block under ep_size=1
        assert ep2["ep_blocks"] and {s[2] for s in ep2["sites"]} == {"autoep-router"}
        assert {s[2] for s in ep1["sites"]} == {"expert-indices"}
    if family == "afmoe":  # a frozen parameter: partitioned by ZeRO-3, updated through a gather
        assert len(ep2["partitioned"]) == len(ep1["partitioned"]) == 2
    for step in range(J.HF_STEPS):
        for rank in ranks:
            assert rank[f"{family}:2"]["biases"][step] == ep2["biases"][step]
        assert _max_gap(ep2["biases"][step], ep1["biases"][step]) < 1e-7, step
        for rank in ranks:
            a, b = rank[f"{family}:2"]["records"][step], rank[f"{family}:1"]["records"][step]
            assert a["indices"] == b["indices"] and a["router_logits"] > 0
            _assert_losses(a, b, keys=("loss", "z_loss"))
    # each step moves each bias by 0 or +-rate, and the biases did move
    changes = [y - x for before, after in zip(ep2["biases"], ep2["biases"][1:])
               for k in before for x, y in zip(before[k], after[k])]
    assert all(abs(d) < 1e-6 or abs(abs(d) - J.HF_RATE) < 1e-6 for d in changes) and any(abs(d) > 1e-6 for d in changes)


def test_a_bias_changed_on_one_rank_stops_every_rank_with_the_entry_id(job):
    from lightning_zeromoe.balance.balancer import DIVERGED

    for rank in job:
        result = rank["diverged"]
        assert result["entry_id"] == DIVERGED and result["updates"] == 2
        assert result["error"].startswith(f"[{DIVERGED}] ") and "differs between ranks by up to 0.25 at step 2" in result["error"]
    assert knowledge.match(job[0]["diverged"]["error"])[0].entry.id == DIVERGED


def test_a_bf16_bias_keeps_moving_by_steps_smaller_than_bf16_spacing():
    """bf16-true casts the bias to bf16, whose spacing at 0.5 is 2**-8 ~ 0.0039: adding 1e-3 in place
    would round back to 0.5 every step. The balancer steps its fp32 copy and writes that copy's bf16
    value, so the bias still moves, and the model holds exactly the copy in its own dtype."""
    import lightning as L

    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

    L.seed_everything(0, verbose=False)
    module = TinyMoEModule(TinyMoEConfig(score_bias=True, num_layers=1), batch_size=4, num_samples=64)
    with torch.no_grad():
        module.model.layers[0].mlp.gate.e_score_correction_bias.fill_(0.5)
    balancer = ExpertBiasBalancer(update_rate=1e-3)
    L.Trainer(accelerator="cpu", devices=1, max_steps=12, precision="bf16-true", logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[balancer]).fit(module)
    held = module.model.layers[0].mlp.gate.e_score_correction_bias
    [master] = balancer._master
    assert held.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert torch.equal(held.cpu(), master.to(torch.bfloat16))
    moved = (master - 0.5).abs().max()
    assert moved >= 4e-3 and (held.float() != 0.5).any()  # in place, every +-1e-3 would have rounded away
