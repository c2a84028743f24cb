"""``ZeroMoEStrategy(stage="auto", plan_for=...)``: the stage planned before ``configure_model`` builds the model.

Without processes: ``plan_for`` (a directory, its ``config.json``, a ``PretrainedConfig``) is counted
on the meta device exactly as the built model counts, with no weights on disk needed; the stage
follows the device memory; bad input is one ``[entry-id]`` line when the strategy is constructed;
``stage="auto"`` without ``plan_for`` keeps ZeRO-3 for a ``configure_model`` module and says so.

One 2-rank launch (``tests/jobs/pretrained_job.py --stage auto --plan-for DIR``): a ``save_pretrained``
Mixtral loaded with ``from_pretrained`` in ``configure_model`` is built whole (no ``zero.Init``),
trains at stage 1 or 2 (the engine's own stage, no ZeRO-3 ``ds_id`` anywhere), and its losses are a
plain single-process run's on the batches each rank received.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from support.jobs import read_ranks, run_job
from support.pretrained import SEQ_LEN, VOCAB, build_tiny_mixtral, lm_loss, plain_reference
from lightning_zeromoe import ZeroMoEStrategy
from lightning_zeromoe.config import World, ZeroMoEConfigError, builds_in_configure_model, options_before_model
from lightning_zeromoe.config.deepspeed import ZeroOptions
from lightning_zeromoe.planner import GB, count_params, plan
from lightning_zeromoe.planner.plan_for import choose_before_model, count_plan_for
from lightning_zeromoe.planner.setups import LADDER
from lightning_zeromoe.reference.models import SyntheticLMData

STEPS, BATCH = 3, 2
#: fp32 on both sides, as tests/test_pretrained.py: summation order in the experts and the all-reduce.
RTOL = 2e-5


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_for") / "mixtral"
    build_tiny_mixtral().save_pretrained(path)
    return path


def test_plan_for_counts_on_the_meta_device_what_from_pretrained_builds(mixtral_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = count_params(AutoModelForCausalLM.from_pretrained(mixtral_dir))
    config_only = tmp_path / "config_only"  # no weights on disk: counting needs none
    config_only.mkdir()
    shutil.copy(mixtral_dir / "config.json", config_only / "config.json")
    for plan_for in (mixtral_dir, str(config_only), config_only / "config.json", AutoConfig.from_pretrained(mixtral_dir)):
        counted = count_plan_for(plan_for)
        assert counted.facts.counts == loaded, plan_for
        assert counted.facts.num_experts == 4 and counted.facts.counts.expert_total > 0
    assert ZeroMoEStrategy(stage="auto", plan_for=config_only, ep_size=2).plan_for.facts.counts == loaded


def _larger_mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2)


def test_the_stage_follows_the_device_memory_and_the_line_gives_each_stages_memory():
    """Plenty of memory: stage 1 or 2, built whole; memory in which only ZeRO-3 fits: 3, built under zero.Init."""
    counted = count_plan_for(_larger_mixtral())
    world = dict(world_size=2, devices_per_node=2, ep_size=2, precision="32-true")
    need = {s.stage: s for s in LADDER if not s.offload_optimizer}
    memory = plan(counts=counted.facts.counts, num_gpus=2, ep_size=2, gpu_memory_bytes=1.0, precision="fp32")
    bytes_of = {stage: memory.device_bytes(setup) for stage, setup in need.items()}
    assert bytes_of[3] < bytes_of[2] <= bytes_of[1], bytes_of

    roomy = choose_before_model(counted, device_memory_bytes=10 * bytes_of[1], **world)
    assert roomy.stage in (1, 2) and "whole on every rank (no zero.Init)" in roomy.line
    tight = choose_before_model(counted, device_memory_bytes=(bytes_of[3] + bytes_of[2]) / 2 / 0.9, **world)
    assert tight.stage == 3 and "partitioned under zero.Init" in tight.line
    for stage in (1, 2, 3):
        assert f"ZeRO-{stage} {bytes_of[stage] / GB:.2f} GB" in tight.line
    assert f"ZeRO-3 {bytes_of[3] / GB:.2f} GB (chosen)" in tight.line
    assert f"{counted.facts.counts.total:,} parameters" in tight.line


def _refused(**kwargs) -> str:
    with pytest.raises(ZeroMoEConfigError) as err:
        ZeroMoEStrategy(**kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_plan_for_is_one_line_from_the_knowledge_base_at_construction(mixtral_dir, tmp_path):
    from transformers import LlamaConfig

    assert _refused(stage=3, plan_for=mixtral_dir).startswith("[plan-for-invalid] plan_for=")
    assert "stage=3" in _refused(stage=3, plan_for=mixtral_dir)
    assert "neither an existing file" in _refused(stage="auto", plan_for=tmp_path / "no" / "such" / "dir")
    assert "without config.json" in _refused(stage="auto", plan_for=tmp_path)
    assert "not int" in _refused(stage="auto", plan_for=3)
    dense = tmp_path / "llama"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(dense)
    assert _refused(stage="auto", plan_for=dense).startswith("[planner-hf-config] model_type 'llama' builds no routed")
    for message in (_refused(stage="auto", plan_for=3), _refused(stage="auto", plan_for=tmp_path)):
        assert message.startswith("[plan-for-invalid] ") and "Pass the directory" in message


def test_a_hub_id_reads_only_its_config_and_says_so_when_it_cannot(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = _refused(stage="auto", plan_for="no-such-org/no-such-model")
    assert message.startswith("[plan-for-invalid] plan_for='no-such-org/no-such-model' is no local path, and its "
                              "config.json could not be read from the Hugging Face hub")


def test_auto_without_plan_for_keeps_3_for_a_configure_model_module_and_says_how_to_plan(mixtral_dir):
    import lightning as L

    class Loads(L.LightningModule):
        def configure_model(self) -> None:
            pass

    world = World(world_size=2, devices_per_node=2, on_cpu=True)
    common = dict(world=world, device_memory_bytes=lambda: 64 * GB)
    options = ZeroOptions(stage=3, ep_size=2)
    assert builds_in_configure_model(Loads()) and not builds_in_configure_model(L.LightningModule())
    kept, line = options_before_model(options, auto_stage=True, user=None, plan_for=None, builds_later=True, **common)
    assert kept.stage == 3 and line.startswith("[stage-auto-kept-3] ") and "plan_for=" in line
    assert options_before_model(options, auto_stage=True, user=None, plan_for=None, builds_later=False,
                                **common) == (options, None)
    counted = count_plan_for(mixtral_dir)
    planned, line = options_before_model(options, auto_stage=True, user=None, plan_for=counted, builds_later=True,
                                         **common)
    assert planned.stage in (1, 2) and line.startswith("ZeroMoEStrategy(stage='auto', plan_for=")
    # A zero_optimization.stage in the user's config wins: nothing is planned.
    user = {"zero_optimization": {"stage": 3}}
    assert options_before_model(options, auto_stage=True, user=user, plan_for=counted, builds_later=True,
                                **common) == (options, None)


@pytest.fixture(scope="module")
def auto_run(mixtral_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_for_out")
    run_job("pretrained_job.py", "--pretrained", str(mixtral_dir), "--out", str(out), "--steps", str(STEPS),
            "--accumulate", "1", "--batch-size", str(BATCH), "--audit-steps", "0", "--stage", "auto",
            "--plan-for", str(mixtral_dir), timeout=600)
    return read_ranks(out, 2)


def test_a_pretrained_model_that_fits_unsharded_builds_and_trains_at_stage_1_or_2_at_parity(mixtral_dir, auto_run):
    ranks = auto_run
    planned = [line for line in ranks[0]["stage_lines"] if line.startswith("ZeroMoEStrategy(stage='auto', plan_for=")]
    assert len(planned) == 1, ranks[0]["stage_lines"]
    replanned = [line for line in ranks[0]["stage_lines"] if line.startswith("ZeroMoEStrategy(stage='auto'): ")]
    assert not replanned, f"setup planned a second time: {replanned}"
    stage = ranks[0]["engine"]["zero_stage"]
    assert stage in (1, 2) and f"; stage {stage}, so configure_model builds the model whole" in planned[0]
    for r in ranks:
        assert r["engine"] == {"zero_stage": stage, "with_ds_id": 0}, r["engine"]
        assert r["load"]["with_ds_id"] == 0, "from_pretrained built under zero.Init"
        assert r["autoep_layers"] == [[4, 2, 2], [4, 2, 2]], "AutoEP did not convert both blocks"
    ref = plain_reference(mixtral_dir, ranks, steps=STEPS, accumulate=1, batch=BATCH)
    for r in (0, 1):
        got = [s["loss"] for s in ranks[r]["steps"]]
        rel = [abs(a - b) / abs(b) for a, b in zip(got, ref[r], strict=True)]
        assert max(rel) < RTOL, f"rank {r}: max relative difference {max(rel):.2e} per step {rel}"
    # The first loss is the saved weights', not a fresh initialisation's.
    first = SyntheticLMData(BATCH * 2 * STEPS, SEQ_LEN, VOCAB, seed=0).tokens[ranks[0]["steps"][0]["indices"]]
    with torch.no_grad():
        assert abs(lm_loss(build_tiny_mixtral(seed=1), first).item() - ref[0][0]) > 1e-3
