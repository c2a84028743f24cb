"""Every claim the knowledge base makes about library behaviour, checked against the installed
libraries for real: the error is triggered, the default is read, the estimator is called.

Each entry of the families this file covers (config, autoep, native-moe-zero3, zero3-pitfalls,
router-collapse) is listed in ``CHECKED`` with the test(s) that check its claims; the coverage test
fails when an entry of those families has none. Heavy imports are fine here (tests only).
Configs are built with ``DeepSpeedConfig`` directly where the claim is about config parsing: it
is the object ``deepspeed.initialize`` builds first. Claims that need a process group run in one
subprocess (tests/jobs/claims_job.py).
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import deepspeed
import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from support.claims import claims
from troubleshooter import explain, knowledge, lint

FAMILIES = {"config", "autoep", "native-moe-zero3", "zero3-pitfalls", "router-collapse"}


def ds_config(config) -> DeepSpeedConfig:
    """DeepSpeedConfig without a process group: world size 1 (what it falls back to)."""
    return DeepSpeedConfig(config)


def raised(fn, *args, **kwargs) -> BaseException:
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the claim is about which exception
        return err
    raise AssertionError(f"{fn.__name__} did not raise")


def test_entries_name_the_installed_versions():
    """checked_against names the deepspeed version that is installed (the claims were read there)."""
    for entry in knowledge.load_entries():
        if entry.family in FAMILIES and re.search(r"\bdeepspeed \d", entry.checked_against):
            assert f"deepspeed {deepspeed.__version__}" in entry.checked_against, entry.id


# --------------------------------------------------------------------------- gather-16bit-on-save

@pytest.fixture(scope="module")
def job() -> dict:
    """tests/jobs/claims_job.py (once per session): the claims that need a process group."""
    return claims()


def test_save_16bit_model_refuses_under_autoep_zero3_whatever_the_flag(job):
    """A real AutoEP + ZeRO-3 engine (tiny Mixtral, one CPU process): save_16bit_model raises
    NotImplementedError with the flag true and false; the entry's pattern recognises it."""
    result = job["save16"]
    for flag in ("true", "false"):
        assert result[flag].startswith("NotImplementedError: save_16bit_model is not supported for "
                                       "AutoEP with ZeRO Stage 3"), result
        assert knowledge.match(result[flag])[0].entry.id == "gather-16bit-on-save"
    assert not list(job["out"].glob("*.bin"))
    entry = knowledge.get("gather-16bit-on-save")
    assert "NotImplementedError" in entry.cause and "whatever" in entry.checked_against
    assert "zeromoe-export" in knowledge.fix("gather-16bit-on-save", "use-zeromoe-export").text


# --------------------------------------------------------------------------- host RAM for offload

def test_offload_host_ram_is_what_deepspeeds_estimator_counts():
    """16 B/param with optimizer offload, 18 with parameter offload, times 1.5 (zero_init, 1 node)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as estimate

    n = 10**9
    cpu_opt, _, _ = estimate(n, 1, num_gpus_per_node=8, cpu_offload=True, cpu_offload_params=False)
    cpu_both, _, _ = estimate(n, 1, num_gpus_per_node=8, cpu_offload=True, cpu_offload_params=True)
    assert (cpu_opt / n, cpu_both / n) == (16 * 1.5, 18 * 1.5) == (24.0, 27.0)
    for entry_id in ("offload-last-resort", "cpu-oom"):
        text = " ".join(knowledge.get(entry_id).cause.split())
        assert "16 bytes per parameter" in text and "18" in text and "1.5" in text, entry_id
        assert "12 bytes" not in text, entry_id
    assert "24 and 27 bytes per parameter" in " ".join(knowledge.get("offload-last-resort").cause.split())


def test_offload_param_below_stage3_is_accepted_and_unused():
    config = ds_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "cpu"}}})
    assert config.zero_optimization_stage == 2  # accepted: no error, and stage 2 never reads it
    assert "ignores it silently" in knowledge.message("offload-last-resort", "param-below-stage3").text


# --------------------------------------------------------------------------- batch arithmetic

def test_batch_assertion_and_derived_accumulation(job):
    err = raised(ds_config, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                             "gradient_accumulation_steps": 4})
    assert "32 != 2 * 4 * 1" in str(err)
    derived = job["batch"]["16/4/8"]
    assert derived == "AssertionError: Gradient accumulation steps: 0 has to be greater than 0"
    [finding] = lint.lint_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, world_size=8)
    assert derived.split(": ", 1)[1] in finding.message  # lint quotes what DeepSpeed really says
    assert knowledge.match(derived)[0].entry.id == "batch-arithmetic"
    # lint's patch: micro 2, accumulation 1 on 8 ranks, which DeepSpeed accepts
    assert finding.patch == {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    assert job["batch"]["16/2/1/8"] == "accepted"


# --------------------------------------------------------------------------- "auto" and types

def test_auto_values_under_raw_deepspeed_match_lints_classification():
    for config in ({"train_batch_size": "auto"}, {"train_batch_size": 2, "train_micro_batch_size_per_gpu": "auto"},
                   {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}):
        err = raised(ds_config, config)
        assert isinstance(err, TypeError) and "'str'" in str(err) and "'int'" in str(err), config
        trace = "".join(traceback.format_exception(err))  # what the user sees
        assert knowledge.match(trace)[0].entry.id == "hf-auto-value", trace
    assert not [m for m in knowledge.match("TypeError: unsupported operand type(s) for //: 'str' and 'int'")
                if m.entry.id == "hf-auto-value"]  # a bare TypeError elsewhere is not this
    base = {"train_batch_size": 1}
    dropped = ds_config({**base, "fp16": {"enabled": "auto"}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto"}})
    assert dropped.float16_config.enabled is False  # "auto" dropped: fp16 silently off
    assert dropped.zero_config.reduce_bucket_size == 5 * 10**8  # the default
    assert ds_config({**base, "gradient_clipping": "auto"}).gradient_clipping == "auto"  # passed on
    kinds = {f.path: f.message_id for f in lint.lint_config(
        {"train_batch_size": "auto", "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
         "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}) if f.rule == "hf-auto-value"}
    assert kinds == {"train_batch_size": "batch-key", "gradient_clipping": "passed-on",
                     "fp16.enabled": "dropped", "zero_optimization.reduce_bucket_size": "dropped"}


def test_hf_trainer_resolves_auto(tmp_path):
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                             gradient_accumulation_steps=4, use_cpu=True, report_to=[])
    hf = HfTrainerDeepSpeedConfig({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                   "gradient_accumulation_steps": "auto", "fp16": {"enabled": "auto"}})
    hf.trainer_config_process(args)
    assert (hf.config["train_batch_size"], hf.config["train_micro_batch_size_per_gpu"],
            hf.config["gradient_accumulation_steps"], hf.config["fp16"]["enabled"]) == (12, 3, 4, False)


def test_wrong_types_fail_inside_deepspeed():
    assert isinstance(raised(ds_config, {"train_batch_size": 1, "fp16": True}), TypeError)
    assert isinstance(raised(ds_config, {"train_batch_size": "8"}), TypeError)
    err = raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"stage": "three"}})
    assert type(err).__name__ == "ValidationError" and "DeepSpeedZeroConfig" in str(err)
    err = raised(ds_config, {"train_batch_size": 1, "fp16": True})
    assert knowledge.match(f"TypeError: {err}")[0].entry.id == "config-value-type"


# --------------------------------------------------------------------------- file format (hjson)

def test_deepspeed_reads_hjson_and_lightning_and_hf_do_not(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  // a comment\n  "train_batch_size": 2,\n  "train_micro_batch_size_per_gpu": 2,\n}\n')
    assert ds_config(str(path)).train_batch_size == 2
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert type(raised(DeepSpeedStrategy, config=str(path))).__name__ == "JSONDecodeError"
    assert isinstance(raised(HfDeepSpeedConfig, str(path)), ValueError)  # JSONDecodeError is one
    [fmt] = [f for f in lint.lint_path(path, consumer="lightning") if f.rule == "config-file-format"]
    assert fmt.severity == "error"


def test_lightning_refuses_gradient_accumulation_steps():
    """The real DeepSpeedStrategy, attached to a real Trainer and LightningModule."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2})
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = BoringModel()
    model.trainer = trainer
    strategy.connect(model)
    err = raised(strategy._format_batch_size_and_grad_accum_config)
    assert type(err).__name__ == "MisconfigurationException"
    assert knowledge.match(str(err))[0].entry.id == "lightning-gradient-accumulation"


# --------------------------------------------------------------------------- zero sections

def test_zero_defaults_and_bounds():
    zero = ds_config({"train_batch_size": 1, "zero_optimization": {"stage": 3}}).zero_config
    assert zero.overlap_comm is True and zero.contiguous_gradients is True  # stage-3 defaults
    assert ds_config({"train_batch_size": 1, "zero_optimization": {"stage": 2}}).zero_config.overlap_comm is False
    assert type(raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": 0}})).__name__ \
        == "ValidationError"
    assert type(raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"allgather_bucket_size": -1}})).__name__ \
        == "ValidationError"
    ok = ds_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "allgather_bucket_size": 0,
                                                                 "stage3_prefetch_bucket_size": 0}})
    assert ok.zero_config.prefetch_bucket_size == 0
    assert zero.gather_16bit_weights_on_model_save is False  # the flag's default


def test_fp16_and_bf16_together_are_refused():
    err = raised(ds_config, {"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert str(err) == "bfloat16 and fp16 modes cannot be simultaneously enabled"
    assert str(err) in lint.lint_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})[0].message


def test_unknown_and_removed_keys():
    err = raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"overlap_com": True}})
    assert "Extra inputs are not permitted" in str(err)
    assert knowledge.match(str(err))[0].entry.id == "unknown-config-key"
    err = raised(ds_config, {"train_batch_size": 1, "amp": {"enabled": True}})
    assert type(err).__name__ == "DeepSpeedConfigError" and "has been removed" in str(err)
    config = ds_config({"train_batch_size": 1, "gradient_acumulation_steps": 4})
    assert config.gradient_accumulation_steps == 1  # the misspelt top-level key: ignored silently


def test_moe_block_is_not_read_by_deepspeed():
    config = ds_config({"train_batch_size": 1, "moe": {"enabled": True, "ep_size": 8, "num_experts": [8]}})
    assert "moe" not in {k.lower() for k in vars(config) if "moe" in k.lower() and getattr(config, k)}


# --------------------------------------------------------------------------- autoep

def test_autoep_refuses_load_balance_coeff():
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    err = raised(parse_autoep_config, {"enabled": True, "autoep_size": 2, "load_balance_coeff": 0.01})
    assert isinstance(err, ValueError) and "load_balance_coeff=0.01 is not supported" in str(err)
    assert knowledge.match(str(err))[0].entry.id == "autoep-load-balance-coeff"
    assert parse_autoep_config({"enabled": True, "autoep_size": 2, "load_balance_coeff": None}).enabled


# --------------------------------------------------------------------------- raised by deepspeed.initialize

@pytest.mark.parametrize("case, entry_id, wording", [
    ("native_zero3", "native-moe-zero3", "AssertionError: Native DeepSpeed MoE is not supported with ZeRO Stage 3"),
    ("native_plain_groups", "moe-param-groups", "None of the param groups are marked as MoE"),
    ("autoep_preset_wrapped", "autoep-no-moe-layers", "AutoEP: no MoE layers detected for preset_model='mixtral'"),
    ("autoep_pattern_wrapped", "autoep-top-k-undetermined", "Could not determine top_k for layer"),
    ("outside_forward", "zero3-param-not-available", "'weight' must be 2-D"),
])
def test_deepspeed_raises_what_the_entry_says(job, case, entry_id, wording):
    """Real engines in tests/jobs/claims_job.py: the error DeepSpeed raises today is the one the
    entry describes, and explain recognises it."""
    message = job["raised"][case]
    assert wording in message, message
    assert entry_id in {m.entry.id for m in knowledge.match(message)}, message


def test_native_moe_ep_size_must_divide_experts():
    from torch import nn
    from deepspeed.moe.layer import MoE

    err = raised(MoE, hidden_size=8, expert=nn.Linear(8, 8), num_experts=3, ep_size=2, k=1)
    assert str(err) == "Number of experts (3) should be divisible by expert parallel size (2)"
    assert knowledge.match(f"AssertionError: {err}")[0].entry.id == "ep-size-divisibility"


def test_device_mismatch_message_is_torchs():
    import torch

    err = raised(lambda: torch.ones(2) + torch.ones(2, device="meta"))
    assert "is not on the expected device" in str(err)
    assert knowledge.match(f"RuntimeError: {err}")[0].entry.id == "device-mismatch"


def test_native_gating_returns_the_aux_loss_and_takes_jitter():
    """router-collapse: native MoE's gate returns l_aux (to be added to the loss) and accepts
    noisy_gate_policy='Jitter'; AutoEP's layer counts tokens per expert."""
    import inspect

    import torch
    from deepspeed.module_inject import auto_ep_layer
    from deepspeed.moe.sharded_moe import top1gating

    torch.manual_seed(0)
    l_aux, *_ = top1gating(torch.randn(16, 4), capacity_factor=1.0, min_capacity=1, noisy_gate_policy="Jitter")
    assert l_aux.dim() == 0 and float(l_aux) > 0
    assert "tokens_per_expert" in inspect.getsource(auto_ep_layer)


def test_zero3_reset_step_releases_inflight_params():
    """zero3-inflight-params: 0.19.8's reset_step releases in-flight params instead of raising."""
    import inspect

    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    source = inspect.getsource(Coordinator.reset_step)
    assert "_clean_inflight_param_registry()" in source and "still have inflight params" not in source


# --------------------------------------------------------------------------- explain's readings

def test_fp16_loss_scaler_wording_and_minimum_are_deepspeeds(monkeypatch):
    """A real DynamicLossScaler (only its rank lookup stubbed: no process group here) halves the
    scale on each overflow down to min_scale, then raises; explain reports that as a collapse and
    a short start-up search as nothing. The config's defaults are 2^16 and min 1."""
    import logging

    import torch
    from deepspeed import comm
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils import logger

    from troubleshooter import explain

    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        scaler = DynamicLossScaler(init_scale=16, scale_window=1000, min_scale=1, delayed_shift=1,
                                   consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.half)
        for _ in range(2):
            scaler.update_scale(True)
        start = "\n".join(lines)
        for _ in range(2):
            scaler.update_scale(True)
        minimum = raised(scaler.update_scale, True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert lines[0] == "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 16, reducing to 8"
    assert lines[-1].endswith("reducing to 1") and str(minimum).startswith("Current loss scale already at minimum")
    assert explain.explain_text(start) == []
    collapse = explain.explain_text("\n".join(lines))[0]
    assert collapse.entry_id == "fp16-moe" and "fell to 1" in collapse.finding
    fp16 = ds_config({"train_batch_size": 1, "fp16": {"enabled": True}}).float16_config
    assert (fp16.initial_scale_power, fp16.min_loss_scale) == (16, 1)
    import inspect

    from deepspeed.runtime import engine
    assert 'f"step={step}, skipped={self.skipped_steps}' in inspect.getsource(engine)


def test_printed_gate_counts_of_a_collapsed_router_are_read_as_collapse():
    """router-collapse: native top1gating's exp_counts (tokens per expert), printed as users do."""
    import torch
    from deepspeed.moe.sharded_moe import top1gating

    from troubleshooter import explain

    torch.manual_seed(0)
    logits = torch.randn(256, 8)
    *_, balanced = top1gating(logits, capacity_factor=8.0, min_capacity=1)
    logits[:, 3] += 20.0  # every token's router now prefers expert 3
    *_, collapsed = top1gating(logits, capacity_factor=8.0, min_capacity=1)
    assert explain.explain_text(f"[rank0]: exp_counts: {balanced}") == []
    d = explain.explain_text(f"[rank0]: exp_counts: {collapsed}")[0]
    assert d.entry_id == "router-collapse" and "expert 3" in d.finding


# --------------------------------------------------------------------------- issue-21 entries

def test_native_gating_asserts_are_deepspeeds_and_torchs():
    import inspect

    import torch
    import torch.nn.functional as F
    from deepspeed.moe import sharded_moe
    from deepspeed.moe.layer import MoE

    err = raised(sharded_moe.top1gating, torch.randn(2, 4), capacity_factor=1.0, min_capacity=4)
    assert str(err).startswith("No. of tokens (batch-size) should be greater than min_capacity")
    trace = "".join(traceback.format_exception(err))  # frames through sharded_moe.py, as users see it
    assert knowledge.match(trace)[0].entry.id == "native-moe-gating-assert"
    assert inspect.signature(MoE.__init__).parameters["min_capacity"].default == 4
    one_hot = raised(F.one_hot, torch.tensor([5]), num_classes=4)
    assert str(one_hot) == "Class values must be smaller than num_classes."
    source = inspect.getsource(sharded_moe)
    assert "F.one_hot(indices1_s, num_classes=num_experts)" in source and "num_classes=capacity" in source
    in_gate = (f'  File "{sharded_moe.__file__}", line 238, in top1gating\n'
               f"    mask1 = F.one_hot(indices1_s, num_classes=num_experts)\nRuntimeError: {one_hot}\n")
    assert knowledge.match(in_gate)[0].entry.id == "native-moe-gating-assert"
    assert not any(m.entry.id == "native-moe-gating-assert" for m in knowledge.match(f"RuntimeError: {one_hot}"))


def test_ds_to_universal_refusals_are_the_installed_ones():
    from deepspeed.checkpoint import ds_to_universal

    root = Path(ds_to_universal.__file__).parent
    source = (root / "ds_to_universal.py").read_text()
    for wording in ("Missing ZeRO-3 checkpoint file for tp_rank=", "ZeRO-3 checkpoint model/optimizer rank sets do not match: ",
                    "Missing ZeRO optimizer checkpoint for rank", "disagree on shape", "No fragment files for tp rank",
                    "All shards must have the same step value", "Duplicate ZeRO rank", ".reshape(slice_shapes[tp_index])"):
        assert wording in source, wording
    assert "assert self.zero_checkpoint.num_files % (self.pp_degree * self.tp_degree) == 0" in \
        (root / "deepspeed_checkpoint.py").read_text()
    err = raised(ds_to_universal._validate_zero3_model_optim_rank_sets,
                 [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(4)],
                 [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)])
    assert "model_only=[2, 3]" in str(err)
    assert knowledge.match("".join(traceback.format_exception(err)))[0].entry.id == "ds-to-universal-mismatch"


def test_zero3_conversion_adds_the_ds_attributes_a_plain_parameter_lacks():
    import inspect

    import torch
    from deepspeed.runtime.zero import parameter_offload, partition_parameters

    err = raised(getattr, torch.nn.Parameter(torch.ones(2)), "ds_numel")
    assert str(err) == "'Parameter' object has no attribute 'ds_numel'"
    assert knowledge.match(f"AttributeError: {err}")[0].entry.id == "zero3-param-not-converted"
    convert = inspect.getsource(partition_parameters.Init._convert_to_deepspeed_param)
    assert all(f"param.{a} = " in convert for a in ("ds_id", "ds_numel", "ds_shape", "ds_tensor", "ds_status"))
    assert "_convert_to_zero_parameters" in inspect.getsource(parameter_offload.DeepSpeedZeRoOffload)
    assert "zero.Init resolved a process group of world_size=1" in inspect.getsource(partition_parameters)
    fan = raised(torch.nn.init.xavier_uniform_, torch.empty(0))  # a zero.Init placeholder is 1-D, empty
    assert str(fan) == "Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"
    near = f'  File "{partition_parameters.__file__}", line 348, in __exit__\nValueError: {fan}\n'
    assert knowledge.match(near)[0].entry.id == "zero3-param-not-converted"


def test_collective_size_mismatch_wordings_and_leaf_modules():
    """gloo's abort and torch's DETAIL check are strings of the installed libtorch; the leaf-module
    fix is a real config field and function of deepspeed 0.19.8."""
    import mmap

    import torch
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    with lib.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for wording in (b"Received data size doesn't match expected size. Is there a distributed collective mismatch "
                        b"in your code?", b"op.preamble.length <= op.nbytes",
                        b"Detected mismatch between collectives on ranks", b"Collectives differ in the following aspects"):
            assert data.find(wording) != -1, wording
    zero = DeepSpeedZeroConfig(stage=3, leaf_module={"classes": ["my_model.MoEBlock"], "name_suffixes": "mlp"})
    assert zero.leaf_module.classes == ["my_model.MoEBlock"] and zero.leaf_module.name_suffixes == ["mlp"]
    assert any(c.endswith("MixtralSparseMoeBlock") for c in DeepSpeedZeroConfig(stage=3).leaf_module.classes)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Block())
    [leaf] = set_z3_leaf_modules(model, [Block])
    assert leaf is model[1] and z3_leaf_module(model[1])
    fix = knowledge.fix("zero3-moe-gather-mismatch", "leaf-modules").text
    assert "zero_optimization.leaf_module.classes" in fix and "set_z3_leaf_modules" in fix


def test_moe_token_dispatch_is_an_all_to_all():
    """nccl-all-to-all-error: NCCL errors there come from the MoE dispatch's all-to-all."""
    import inspect

    import torch
    from deepspeed.module_inject import auto_ep_layer
    from deepspeed.moe import sharded_moe

    assert "dist.all_to_all_single(output, input, group=group)" in inspect.getsource(sharded_moe._AllToAll.forward)
    assert "all_to_all" in inspect.getsource(auto_ep_layer)
    assert issubclass(torch.distributed.DistBackendError, RuntimeError)


def test_ds_skip_cuda_check_bypasses_deepspeeds_check_only():
    """cuda-version-mismatch's skip_when: torch's own check has no switch for a major mismatch."""
    import inspect

    import torch.utils.cpp_extension as cpp
    from deepspeed.ops.op_builder import builder

    torch_check = inspect.getsource(cpp._check_cuda_version)
    raise_at = torch_check.index("raise RuntimeError(CUDA_MISMATCH_MESSAGE")
    assert "environ" not in torch_check[:raise_at] and "DS_SKIP_CUDA_CHECK" not in inspect.getsource(cpp)
    assert 'os.getenv("DS_SKIP_CUDA_CHECK", "0") == "1"' in inspect.getsource(builder.assert_no_cuda_mismatch)
    fix = knowledge.fix("cuda-version-mismatch", "skip-cuda-check")
    assert re.search(fix.skip_when, cpp.CUDA_MISMATCH_MESSAGE % ("13.0", "12.8"), re.I)  # torch's own text
    assert not re.search(fix.skip_when, "CUDAMismatchException: >- DeepSpeed Op Builder: Installed CUDA version 13.0")
    assert "_check_cuda_version" in fix.skip_why


def test_a_waiting_jit_build_prints_nothing_until_the_lock_goes():
    """stale-extension-lock: torch prints 'Loading extension module' only after FileBaton.wait()
    returns, and DeepSpeed 'Time to load <op> op' after that, so either line after the
    extensions-root line means the build moved on; the wait itself has no timeout."""
    import inspect

    import torch.utils.cpp_extension as cpp
    from deepspeed.ops.op_builder import builder
    from torch.utils.file_baton import FileBaton

    jit = inspect.getsource(cpp._jit_compile)
    if "baton.wait()" not in jit:  # torch 2.15: an OS advisory lock, released when its holder dies
        assert "FileLock(os.path.join(build_directory, 'lock'))" in jit and "FileBaton(" not in jit
        from lightning_zeromoe import knowledge

        assert "torch 2.15.0 no longer does" in knowledge.get("stale-extension-lock").checked_against
        return
    wait, loading = jit.index("baton.wait()"), jit.index("Loading extension module %s...")
    assert wait < loading and "Emitting ninja build file" not in jit[wait:]
    assert "timeout" not in inspect.getsource(FileBaton.wait).lower()
    assert 'print(f"Time to load {self.name} op: {build_duration} seconds")' in inspect.getsource(builder)


def test_comment_keys_and_rename_targets_are_as_lint_says():
    """lint: "_comment" is ignored at the top level and refused in a pydantic section; the rename
    targets lint refuses really do not take such values."""
    assert ds_config({"train_batch_size": 1, "_comment": "x"}).train_batch_size == 1
    err = raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"stage": 2, "_comment": "x"}})
    assert type(err).__name__ == "ValidationError" and "Extra inputs are not permitted" in str(err)
    assert isinstance(raised(ds_config, {"train_batch_size": 1, "comms_logger": "verbose"}), TypeError)
    import inspect

    from deepspeed.runtime import config
    assert 'dist.get_world_size() / config["sequence_parallel_size"]' in inspect.getsource(config)


# --------------------------------------------------------------------------- coverage

#: Entry -> the tests in this file (or elsewhere, named) that check its library claims for real.
CHECKED = {
    "gather-16bit-on-save": ["test_save_16bit_model_refuses_under_autoep_zero3_whatever_the_flag"],
    "offload-last-resort": ["test_offload_host_ram_is_what_deepspeeds_estimator_counts",
                            "test_offload_param_below_stage3_is_accepted_and_unused"],
    "batch-arithmetic": ["test_batch_assertion_and_derived_accumulation"],
    "hf-auto-value": ["test_auto_values_under_raw_deepspeed_match_lints_classification",
                      "test_hf_trainer_resolves_auto"],
    "config-value-type": ["test_wrong_types_fail_inside_deepspeed",
                          "test_a_section_given_as_a_boolean_is_a_value_type_error_not_an_unknown_key"],
    "config-file-format": ["test_deepspeed_reads_hjson_and_lightning_and_hf_do_not"],
    "lightning-gradient-accumulation": ["test_lightning_refuses_gradient_accumulation_steps"],
    "zero3-overlap-comm": ["test_zero_defaults_and_bounds"],
    "bucket-size-range": ["test_zero_defaults_and_bounds"],
    "fp16-moe": ["test_fp16_and_bf16_together_are_refused", "test_fp16_loss_scaler_wording_and_minimum_are_deepspeeds"],
    "unknown-config-key": ["test_unknown_and_removed_keys", "test_comment_keys_and_rename_targets_are_as_lint_says"],
    "moe-config-block-ignored": ["test_moe_block_is_not_read_by_deepspeed"],
    "autoep-load-balance-coeff": ["test_autoep_refuses_load_balance_coeff"],
    "native-moe-zero3": ["test_deepspeed_raises_what_the_entry_says"],
    "moe-param-groups": ["test_deepspeed_raises_what_the_entry_says"],
    "autoep-no-moe-layers": ["test_deepspeed_raises_what_the_entry_says"],
    "autoep-top-k-undetermined": ["test_deepspeed_raises_what_the_entry_says"],
    "zero3-param-not-available": ["test_deepspeed_raises_what_the_entry_says"],
    "ep-size-divisibility": ["test_native_moe_ep_size_must_divide_experts"],
    "device-mismatch": ["test_device_mismatch_message_is_torchs"],
    "router-collapse": ["test_native_gating_returns_the_aux_loss_and_takes_jitter",
                        "test_printed_gate_counts_of_a_collapsed_router_are_read_as_collapse"],
    "native-moe-gating-assert": ["test_native_gating_asserts_are_deepspeeds_and_torchs"],
    "ds-to-universal-mismatch": ["test_ds_to_universal_refusals_are_the_installed_ones"],
    "zero3-param-not-converted": ["test_zero3_conversion_adds_the_ds_attributes_a_plain_parameter_lacks"],
    "zero3-moe-gather-mismatch": ["test_collective_size_mismatch_wordings_and_leaf_modules"],
    "nccl-all-to-all-error": ["test_moe_token_dispatch_is_an_all_to_all"],
    "stale-extension-lock": ["test_a_waiting_jit_build_prints_nothing_until_the_lock_goes"],
    "cuda-version-mismatch": ["test_ds_skip_cuda_check_bypasses_deepspeeds_check_only"],
    "zero3-inflight-params": ["test_zero3_reset_step_releases_inflight_params"],
    # our own errors: triggered for real, their messages matched to these entries
    "moe-top-k-range": ["test_own_errors.py::test_every_validation_error_names_its_entry"],
    "ep-size-crosses-nodes": ["test_own_errors.py::test_validation_warnings_name_their_entry"],
    "zero3-module-move": ["test_own_errors.py::test_device_move_error_names_its_entry"],
    "zero3-noop-move": ["test_own_errors.py::test_pitfall_warnings_and_audit_messages_name_their_entry"],
    "zero3-no-gradient": ["test_own_errors.py::test_pitfall_warnings_and_audit_messages_name_their_entry"],
    "zero3-aliased-weight": ["test_own_errors.py::test_pitfall_warnings_and_audit_messages_name_their_entry"],
    # entries from the strategy, export, resume, HF-architecture and explain work: each is
    # triggered for real (a real engine, a real CLI run, a real DeepSpeed error) in its own test
    "native-moe-ep-size": ["test_own_errors.py::test_every_validation_error_names_its_entry",
                           "test_strategy_paths.py::test_native_deepspeed_moe_ep2_matches_plain_pytorch"],
    "autoep-frozen-experts": ["test_lora_ep.py::test_a_copy_without_its_frozen_experts_is_refused_by_resume_and_export"],
    "ep-disabled-by-config": ["test_resolve.py::test_enabled_false_with_ep_size_is_refused_at_construction"],
    "merged-config-invalid": ["test_resolve.py::test_invalid_user_stage_is_refused"],
    "offload-needs-ds-cpu-optimizer": [
        "test_resolve.py::test_offload_with_a_torch_optimizer_is_refused_naming_deepspeed_cpu_adam"],
    "strategy-keyword-refused": ["test_keywords.py::test_zero_optimization_keyword_is_refused_naming_stage_0"],
    "strategy-argument-invalid": ["test_validation.py::test_stage_must_be_a_number_or_auto"],
    "save-after-evaluation": ["test_strategy_paths.py::test_validate_after_fit_and_from_checkpoint_equal_a_plain_eval"],
    "ep-layout": ["test_doctor.py::test_layout"],
    "moe-conversion-mismatch": ["test_hf_semantics.py::test_probe_catches_route_norm_opposite_to_the_config"],
    "resume-shape-unsupported": ["test_resume.py::test_a_shape_change_that_cannot_work_is_refused_before_training"],
    "config-passed-twice": ["test_explain.py::test_real_deepspeed_errors_are_recognised"],
    "load-checkpoint-no-optimizer": ["test_explain.py::test_real_deepspeed_errors_are_recognised"],
    "zero-to-fp32-mismatch": ["test_explain.py::test_zero_to_fp32_messages_are_the_installed_ones"],
    "export-dtype": ["test_own_errors.py::test_export_dtype_refusals_name_their_entry"],
    "export-meta-version": ["test_export_units.py::test_meta_round_trips_and_refuses_other_versions"],
    "export-not-a-checkpoint": ["test_checkpoint.py::test_missing_directory"],
    "export-output-path": ["test_checkpoint.py::test_export_dtype_and_no_silent_overwrite",
                           "test_export_safety.py::test_overwrite_never_removes_a_directory_that_holds_the_checkpoint"],
    "export-disk-full": ["test_export_safety.py::test_full_disk_is_one_clear_error_and_leaves_everything_as_it_was"],
    "checkpoint-disk-full": [
        "test_checkpoint_faults.py::test_a_full_disk_on_one_rank_is_a_clear_error_and_the_earlier_checkpoint_survives"],
    "bias-balancing-refused": [
        "test_balancing.py::test_a_model_without_a_choice_only_bias_is_refused_with_the_reason",
        "test_balancing.py::test_every_family_with_a_choice_only_bias_is_found_and_it_steers_only_the_choice"],
    "bias-balancing-diverged": ["test_balancing.py::test_a_bias_changed_on_one_rank_stops_every_rank_with_the_entry_id"],
    "moe-no-expert-parallel": ["test_expert_list_moe.py::test_no_expert_parallel_warning_is_one_rule_for_every_kind_of_model",
                               "test_expert_list_moe.py::test_ep2_switch_falls_back_to_leaf_modules_with_the_one_warning"],
    "export-shard-corrupt": ["test_checkpoint.py::test_truncated_shard"],
    "export-shards-mismatch": ["test_checkpoint.py::test_missing_rank_shard"],
    "export-unsupported-model": ["test_export_units.py::test_lora_merge_and_adapter_names"],
    "export-untrusted-object": ["test_checkpoint.py::test_checkpoint_holding_a_custom_class_is_refused_unless_trusted"],
    "planner-hf-config": ["test_planner_cli.py::test_bad_input_is_one_line_with_its_entry_and_exit_2"],
    "plan-for-invalid": ["test_plan_for.py::test_bad_plan_for_is_one_line_from_the_knowledge_base_at_construction",
                         "test_plan_for.py::test_a_hub_id_reads_only_its_config_and_says_so_when_it_cannot"],
    "stage-auto-kept-3": [
        "test_plan_for.py::test_auto_without_plan_for_keeps_3_for_a_configure_model_module_and_says_how_to_plan"],
    "peft-variant-zero-init": [
        "test_peft_zero_init.py::test_lora_init_under_zero_init_is_peft_own_and_variants_are_refused"],
    "autoep-several-models": ["test_library_refusals.py::test_two_hf_moe_models_refusal_names_its_entry"],
    "collective-backend": ["test_library_refusals.py::test_collectives_refusals_name_their_entry"],
    "moe-pattern-routing": ["test_library_refusals.py::test_a_pattern_whose_routing_cannot_be_written_names_its_entry"],
    "native-moe-mixed-blocks": ["test_native_moe_auto.py::test_native_layers_beside_autoep_blocks_are_refused",
                                "test_native_moe_auto.py::test_native_layers_without_expert_parallelism_beside_blocks_train_as_built"],
}


def test_every_claim_bearing_entry_of_these_families_has_a_real_check():
    names = {n for n in globals() if n.startswith("test_")}
    for entry_id, tests in CHECKED.items():
        knowledge.get(entry_id)
        for test in tests:
            module, _, name = test.rpartition("::")
            if module:
                assert f"def {name}(" in (Path(__file__).parent / module).read_text(), test
            else:
                assert test in names, test
    unchecked = sorted(e.id for e in knowledge.load_entries()
                       if e.family in FAMILIES and e.id not in CHECKED and e.id not in PENDING_CHECKS)
    assert unchecked == []


#: Claim-bearing entries of these families without a check against the installed libraries: the
#: claim is about a transformers version that is not installed (its symptom is kept in
#: lightning_zeromoe/compat.py and matched by tests/test_knowledge.py).
PENDING_CHECKS = {"autoep-transformers-5.23"}  # needs transformers 5.23 installed; measured once


def test_a_section_given_as_a_boolean_is_a_value_type_error_not_an_unknown_key():
    """pydantic's type errors inside DeepSpeed's ValidationError name config-value-type, with the key
    and what was given; an unknown key in the same model stays unknown-config-key."""
    err = raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"offload_optimizer": True}})
    text = f"{type(err).__name__}: {err}"
    assert "Input should be a valid dictionary" in text
    found = explain.explain_text(text)
    assert [d.entry_id for d in found] == ["config-value-type"]
    assert found[0].details["path"] == "offload_optimizer" and found[0].details["found"] == "bool"
    assert "Make 'offload_optimizer' dictionary" in found[0].fix[0]
    err = raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": "big"}})
    assert explain.explain_text(f"{type(err).__name__}: {err}")[0].entry_id == "config-value-type"
    err = raised(ds_config, {"train_batch_size": 1, "zero_optimization": {"overlap_com": True}})
    assert explain.explain_text(f"{type(err).__name__}: {err}")[0].entry_id == "unknown-config-key"
