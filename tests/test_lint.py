"""lint: the seeds' configs, a Lightning-generated config, every rule, and clean input errors.

Key names are checked against the installed DeepSpeed (harvested once per session into a
temporary cache directory, so the test exercises the real harvest, not a stale cache).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from troubleshooter import ds_schema, lint

SEEDS = Path(__file__).parent / "fixtures" / "seed_configs"
TRACEBACKS = Path(__file__).parent / "fixtures" / "tracebacks"


@pytest.fixture(scope="module", autouse=True)
def fresh_schema_cache(tmp_path_factory):
    """Harvest DeepSpeed's key sets for real into this session's own cache directory (shared
    with test_cli.py, so the harvest runs once per session, never from a stale user cache)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TROUBLESHOOTER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ds_cache"))
    ds_schema.load_schema.cache_clear()
    yield
    ds_schema.load_schema.cache_clear()
    mp.undo()


def _by(findings, rule=None, severity=None, path=None):
    return [f for f in findings if (rule is None or f.rule == rule)
            and (severity is None or f.severity == severity) and (path is None or f.path == path)]


def test_schema_is_harvested_from_deepspeed_and_cached():
    schema = ds_schema.load_schema()
    assert {"zero_optimization", "expert_parallel", "train_batch_size", "aio"} <= schema.top_level
    assert "moe" not in schema.top_level  # the seeds' block is not a DeepSpeed section
    assert {"stage3_prefetch_bucket_size", "prefetch_bucket_size", "overlap_comm"} <= \
        schema.strict_sections["zero_optimization"]
    assert "pin_memory" in schema.strict_sections["zero_optimization.offload_optimizer"]
    assert {"autoep_size", "preset_model", "top_k"} <= schema.loose_sections["expert_parallel"]
    assert "amp" in schema.removed
    assert ds_schema.cache_path(schema.deepspeed_version).is_file()


def test_seed_moe_config(tmp_path):
    """Seed 002, section 4.2: a native-MoE block under stage 3, fp16, offload."""
    findings = lint.lint_path(SEEDS / "seed002_zero3_moe.json", world_size=8)
    assert [f.rule for f in _by(findings, severity="error")] == ["native-moe-zero3"]
    assert _by(findings, "moe-config-block-ignored", "warning", "moe")
    per_key = {f.path for f in _by(findings, "moe-config-block-ignored", "info")}
    assert per_key == {f"moe.{k}" for k in ("enable", "num_experts", "top_k", "ep_size", "min_capacity",
                                            "drop_tokens", "noisy_gate_policy", "load_balance_loss_weight")}
    assert _by(findings, "fp16-moe", "warning")
    assert _by(findings, "offload-last-resort", "info", "zero_optimization.offload_optimizer.device")
    assert not _by(findings, "unknown-config-key")  # every other key is a real DeepSpeed key
    assert not _by(findings, "batch-arithmetic")  # 32 = 1 x 4 x 8


def test_seed_moe_config_on_a_world_that_does_not_fit():
    findings = lint.lint_path(SEEDS / "seed002_zero3_moe.json", world_size=5)
    errors = {f.rule for f in _by(findings, severity="error")}
    assert errors == {"native-moe-zero3", "batch-arithmetic", "ep-size-divisibility"}
    batch = _by(findings, "batch-arithmetic")[0]
    assert "32 != 1 * 4 * 5" in batch.message  # DeepSpeed's integer division: 32 // 5 // 4 = 1


def test_seed_dense_config():
    """Seed 002, section 2.3: valid for DeepSpeed; only the offload note remains."""
    findings = lint.lint_path(SEEDS / "seed002_zero3_dense.json", world_size=8)
    assert [(f.rule, f.severity) for f in findings] == [("offload-last-resort", "info")]


def test_seed000_config():
    """Seed 000, section 3.1 (quotes restored): MoE block, fp16, both offloads, 16-bit gather."""
    findings = lint.lint_path(SEEDS / "seed000_zero3_moe_offload.json")
    assert {f.rule for f in _by(findings, severity="error")} == {"native-moe-zero3"}
    assert len(_by(findings, "offload-last-resort", "info")) == 2
    assert _by(findings, "gather-16bit-on-save", "info")
    batch = _by(findings, "batch-arithmetic")[0]
    assert batch.severity == "info" and "[1, 2, 4, 8, 16]" in batch.message


def test_lightning_generated_config_is_accepted():
    findings = lint.lint_path(SEEDS / "lightning_stage3_offload.json", world_size=2)
    assert not _by(findings, severity="error") and not _by(findings, severity="warning")
    assert _by(findings, "unknown-config-key", "info", "aio.thread_count")


def test_auto_values_are_skipped():
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "fp16": {"enabled": "auto"},
              "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto"}}
    assert lint.lint_config(config, world_size=8) == []


def test_misspelled_zero_key_is_an_error_like_deepspeed_says():
    """The same config made DeepSpeed raise in tests/fixtures/tracebacks/real_unknown_zero_key.txt."""
    assert "Extra inputs are not permitted" in (TRACEBACKS / "real_unknown_zero_key.txt").read_text()
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "overlap_com": True}}
    [finding] = _by(lint.lint_config(config), "unknown-config-key")
    assert finding.severity == "error" and finding.path == "zero_optimization.overlap_com"
    assert "'overlap_comm'" in finding.message
    fixed = lint.merge_patch(config, finding.patch)
    assert fixed == {"train_batch_size": 1, "zero_optimization": {"stage": 3, "overlap_comm": True}}
    assert lint.lint_config(fixed) == []


def test_removed_key_is_an_error_with_deepspeeds_message():
    assert "has been removed" in (TRACEBACKS / "real_removed_config_key.txt").read_text()
    [finding] = _by(lint.lint_config({"train_batch_size": 1, "amp": {"enabled": True}}), "unknown-config-key")
    assert finding.severity == "error" and "Apex AMP" in finding.message


def test_silently_ignored_keys_are_warnings_with_suggestions():
    config = {"train_batch_size": 8, "gradient_acumulation_steps": 2,
              "expert_parallel": {"enabled": True, "autoep_sise": 2}}
    findings = _by(lint.lint_config(config), "unknown-config-key")
    assert {(f.path, f.severity) for f in findings} == {
        ("gradient_acumulation_steps", "warning"), ("expert_parallel.autoep_sise", "warning")}
    assert all("Did you mean" in f.message for f in findings)


def test_deprecated_key_is_reported_with_its_replacement():
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    [finding] = _by(lint.lint_config(config), "unknown-config-key")
    assert finding.severity == "info" and "offload_optimizer" in finding.message


def test_batch_arithmetic_mirrors_deepspeed():
    """real_batch_arithmetic.txt: DeepSpeed refused 32 != 2 * 4 * 1; so must lint."""
    assert "32 != 2 * 4 * 1" in (TRACEBACKS / "real_batch_arithmetic.txt").read_text()
    config = {"train_batch_size": 32, "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2}
    [finding] = _by(lint.lint_config(config, world_size=1), "batch-arithmetic")
    assert finding.severity == "error" and "32 != 2 * 4 * 1" in finding.message
    assert _by(lint.lint_config(config, world_size=4), "batch-arithmetic") == []
    [info] = _by(lint.lint_config(config), "batch-arithmetic")
    assert info.severity == "info" and "exactly 4" in info.message


def test_stage3_overlap_and_contiguous_off():
    config = {"zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": False}}
    assert {f.path for f in _by(lint.lint_config(config), "zero3-overlap-comm", "warning")} == {
        "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients"}
    config["zero_optimization"]["stage"] = 2
    assert _by(lint.lint_config(config), "zero3-overlap-comm") == []


def test_autoep_size_must_divide_world_size():
    config = {"zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": True, "autoep_size": 3}}
    [finding] = _by(lint.lint_config(config, world_size=8), "ep-size-divisibility")
    assert finding.severity == "error" and "[1, 2, 4, 8]" in finding.message
    assert _by(lint.lint_config(config, world_size=6), "ep-size-divisibility") == []


def test_native_ep_size_must_divide_experts():
    """deepspeed.moe.layer.MoE refuses 3 experts on ep_size 2 (real_ep_size_divisibility.txt)."""
    config = {"moe": {"num_experts": [4, 3], "ep_size": 2}}
    [finding] = _by(lint.lint_config(config), "ep-size-divisibility")
    assert "num_experts=3" in finding.message


@pytest.mark.parametrize("key, value, severity", [
    ("reduce_bucket_size", 1000, "warning"),
    ("reduce_bucket_size", 5e9, "warning"),
    ("reduce_bucket_size", 0, "error"),
    ("stage3_prefetch_bucket_size", 0, "info"),
    ("allgather_bucket_size", 5e8, None),
])
def test_bucket_sizes(key, value, severity):
    findings = _by(lint.lint_config({"zero_optimization": {"stage": 3, key: value}}), "bucket-size-range")
    assert [f.severity for f in findings] == ([severity] if severity else [])


def test_fp16_and_bf16_together_is_an_error():
    findings = lint.lint_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert [f.severity for f in _by(findings, "fp16-moe")] == ["error"]


def test_load_balance_coeff_is_an_error():
    """deepspeed 0.19.8 refuses it (real_autoep_load_balance_coeff.txt)."""
    config = {"expert_parallel": {"enabled": True, "autoep_size": 2, "load_balance_coeff": 0.01}}
    [finding] = _by(lint.lint_config(config), "autoep-load-balance-coeff")
    assert finding.severity == "error"
    assert _by(lint.lint_config(lint.merge_patch(config, finding.patch)), "autoep-load-balance-coeff") == []


def test_offload_param_below_stage3_is_a_warning():
    config = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    assert _by(lint.lint_config(config), "offload-last-resort", "warning")


def test_every_rule_is_a_knowledge_base_entry():
    from troubleshooter import knowledge

    config = json.loads((SEEDS / "seed002_zero3_moe.json").read_text())
    bad = copy.deepcopy(config)
    bad["zero_optimization"].update(overlap_com=True, reduce_bucket_size=10, overlap_comm=False,
                                    stage3_gather_16bit_weights_on_model_save=True)
    bad["expert_parallel"] = {"enabled": True, "autoep_size": 3, "load_balance_coeff": 0.1}
    rules = {f.rule for f in lint.lint_config(bad, world_size=6)}
    assert len(rules) >= 10
    for rule in rules:
        knowledge.get(rule)


@pytest.mark.parametrize("text, expected", [
    ('{"train_batch_size": 8,\n  "fp16": {"enabled": true,}}', r":2:28: invalid JSON"),
    ('[1, 2]', r"must be a JSON object, got array"),
    ('{"zero_optimization": {"stage": "three"}}', r":1:24: 'zero_optimization.stage' must be an integer"),
    ('{"fp16": true}', r":1:2: 'fp16' must be an object, got boolean"),
    ('{"a": 1,\n "a": 2}', r":2:2: duplicate key 'a'"),
])
def test_bad_input_gives_one_line_error_with_position(tmp_path, text, expected):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(lint.LintInputError, match=expected) as err:
        lint.lint_path(path)
    assert "\n" not in str(err.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(lint.LintInputError, match="no such file"):
        lint.lint_path(tmp_path / "nope.json")
    with pytest.raises(lint.LintInputError, match="is a directory"):
        lint.lint_path(tmp_path)


def test_wrong_type_in_a_dict_names_the_path():
    with pytest.raises(lint.LintInputError, match="<dict>: expert_parallel"):
        lint.lint_config({"expert_parallel": [1]})
