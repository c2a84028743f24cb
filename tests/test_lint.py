"""lint: the seeds' configs, a Lightning-generated config, every rule, each consumer (--for), and
clean input errors.

Key names are checked against the installed DeepSpeed (harvested once per session into a
temporary cache directory, so the test exercises the real harvest, not a stale cache).
"""

from __future__ import annotations

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


def test_seed_moe_config_block_is_one_finding_with_notes():
    """Seed 002, section 4.2: the 'moe' block is not DeepSpeed config. It gets ONE finding (per-key
    notes), and nothing in it is checked as live config: no native-MoE or ep_size errors."""
    findings = lint.lint_path(SEEDS / "seed002_zero3_moe.json", world_size=8)
    moe = [f for f in findings if f.path == "moe" or f.path.startswith("moe.")]
    [block] = moe
    assert (block.rule, block.severity, block.message_id) == ("moe-config-block-ignored", "warning", "block-stage3")
    assert [n.split(" = ")[0] for n in block.notes] == [
        f"moe.{k}" for k in ("enable", "num_experts", "top_k", "ep_size", "min_capacity", "drop_tokens",
                             "noisy_gate_policy", "load_balance_loss_weight")] + ["fp16.enabled"]
    assert "moe.ep_size = 2:" in block.notes[3] and "expert_parallel.autoep_size" in block.notes[3]
    assert block.note_ids[-1] == "note-fp16" and "bf16" in block.notes[-1]  # fp16 on a model the block says is MoE
    assert block.patch == {"moe": None, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert not _by(findings, severity="error")
    assert {f.rule for f in findings} == {"moe-config-block-ignored", "offload-last-resort"}
    # the whole file is one line: the block's position is its key's column there
    text = (SEEDS / "seed002_zero3_moe.json").read_text()
    assert (block.line, block.col) == (1, text.index('"moe"') + 1)


def test_moe_block_keys_never_act_as_live_config():
    """ep_size / num_experts in the ignored block cannot fail divisibility as live config, on any
    world size: the one finding says it in a note instead."""
    config = {"zero_optimization": {"stage": 2}, "moe": {"num_experts": [4, 3], "ep_size": 2}}
    findings = lint.lint_config(config, world_size=5)
    assert [(f.rule, f.message_id) for f in findings] == [("moe-config-block-ignored", "block")]
    note = findings[0].notes[findings[0].note_ids.index("note-ep-size-divides")]
    assert "number of experts (3)" in note and "world size (5)" in note and "number of experts (4)" not in note


def test_moe_block_keeps_the_two_findings_that_stay_true_wherever_its_keys_go():
    """Seed 002's block on 5 ranks: ep_size 2 divides 8 experts but not the world size; fp16 with
    a model the block says is MoE. Both are notes of the one block finding; on 8 ranks only fp16."""
    [five] = [f for f in lint.lint_path(SEEDS / "seed002_zero3_moe.json", world_size=5) if f.path == "moe"]
    assert five.note_ids[-2:] == ("note-fp16", "note-ep-size-divides")
    assert "moe.ep_size = 2 does not divide the world size (5)" in five.notes[-1] and "[1]" in five.notes[-1]
    [eight] = [f for f in lint.lint_path(SEEDS / "seed002_zero3_moe.json", world_size=8) if f.path == "moe"]
    assert "note-ep-size-divides" not in eight.note_ids and "note-fp16" in eight.note_ids
    neither = {"fp16": {"enabled": True}, "moe": {"enabled": True, "num_experts": 6, "ep_size": 4}}
    [block] = lint.lint_config(neither, world_size=10)
    assert "number of experts (6), nor the world size (10)" in block.notes[-1] and "[1, 2]" in block.notes[-1]
    off = {"fp16": {"enabled": True}, "moe": {"enabled": False, "num_experts": 8}}
    assert "note-fp16" not in lint.lint_config(off)[0].note_ids  # the block says: not MoE


def test_seed_moe_config_on_a_world_that_does_not_fit():
    findings = lint.lint_path(SEEDS / "seed002_zero3_moe.json", world_size=5)
    [batch] = _by(findings, severity="error")
    assert batch.rule == "batch-arithmetic"
    assert "32 != 1 * 4 * 5" in batch.message  # DeepSpeed's integer division: 32 // 5 // 4 = 1
    assert batch.fix_id == "set-all-three"  # 32 is not a multiple of 5: no micro batch fits


def test_seed_dense_config():
    """Seed 002, section 2.3: valid for DeepSpeed; only the offload note remains."""
    findings = lint.lint_path(SEEDS / "seed002_zero3_dense.json", world_size=8)
    assert [(f.rule, f.severity) for f in findings] == [("offload-last-resort", "info")]


def test_seed000_config():
    """Seed 000, section 3.1 (quotes restored): MoE block, fp16, both offloads, 16-bit gather
    (plain ZeRO-3 without AutoEP: the flag works there, so information only)."""
    findings = lint.lint_path(SEEDS / "seed000_zero3_moe_offload.json")
    assert not _by(findings, severity="error")
    assert len(_by(findings, "offload-last-resort", "info")) == 2
    assert _by(findings, "gather-16bit-on-save", "info")
    batch = _by(findings, "batch-arithmetic")[0]
    assert batch.severity == "info" and "[1, 2, 4, 8, 16]" in batch.message


def test_gather_16bit_under_autoep_zero3_is_an_error_pointing_to_zeromoe_export():
    """deepspeed 0.19.8's save_16bit_model raises under AutoEP + ZeRO-3 whatever the flag (see
    tests/test_knowledge_claims.py, which triggers it)."""
    config = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
              "expert_parallel": {"enabled": True, "autoep_size": 2}}
    [finding] = _by(lint.lint_config(config), "gather-16bit-on-save")
    assert finding.severity == "error" and finding.fix_id == "use-zeromoe-export"
    assert "NotImplementedError" in finding.message and "zeromoe-export" in finding.fix
    assert "stage3_gather_16bit_weights_on_model_save" in finding.fix  # the key in the fix
    assert _by(lint.lint_config(lint.merge_patch(config, finding.patch)), "gather-16bit-on-save") == []


def test_lightning_generated_config_is_accepted():
    findings = lint.lint_path(SEEDS / "lightning_stage3_offload.json", world_size=2)
    assert not _by(findings, severity="error") and not _by(findings, severity="warning")
    assert _by(findings, "unknown-config-key", "info", "aio.thread_count")


def test_auto_values_are_fine_for_the_hf_trainer_and_errors_for_the_others():
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto"}}
    assert lint.lint_config(config, world_size=8, consumer="hf") == []
    for consumer in ("deepspeed", "lightning"):
        auto = {f.path: f.message_id for f in _by(lint.lint_config(config, world_size=8, consumer=consumer),
                                                 "hf-auto-value", "error")}
        assert auto == {"train_batch_size": "batch-key", "train_micro_batch_size_per_gpu": "batch-key",
                        "gradient_accumulation_steps": "batch-key", "gradient_clipping": "passed-on",
                        "fp16.enabled": "dropped", "bf16.enabled": "dropped",
                        "optimizer.params.lr": "passed-on", "zero_optimization.reduce_bucket_size": "dropped",
                        "zero_optimization.stage3_prefetch_bucket_size": "dropped"}, consumer


def test_lightning_refuses_gradient_accumulation_steps():
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    [finding] = _by(lint.lint_config(config, consumer="lightning"), "lightning-gradient-accumulation")
    assert finding.severity == "error" and "accumulate_grad_batches=4" in finding.fix
    assert not _by(lint.lint_config(config, consumer="deepspeed"), "lightning-gradient-accumulation")


def test_hjson_is_accepted_for_deepspeed_only(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  // DeepSpeed reads this with hjson\n  "train_micro_batch_size_per_gpu": 2,\n'
                    '  "zero_optimization": {"stage": 3, "overlap_com": true,},\n}\n')
    ds = lint.lint_path(path)
    assert [(f.severity, f.line, f.col) for f in _by(ds, "config-file-format")] == [("info", 2, 3)]
    typo = _by(ds, "unknown-config-key")[0]  # the content is still linted
    assert (typo.path, typo.line, typo.col) == ("zero_optimization.overlap_com", 4, 37)
    for consumer in ("lightning", "hf"):
        [fmt] = _by(lint.lint_path(path, consumer=consumer), "config-file-format")
        assert fmt.severity == "error" and "read with json" in fmt.message


def test_every_finding_has_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                "fp16": {"enabled": True}, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "overlap_comm": False,
                                                      "reduce_bucket_size": 10}}, indent=2))
    findings = lint.lint_path(path, world_size=8)
    assert len(findings) >= 4
    lines = path.read_text().splitlines()
    for f in findings:
        key = f.path.rsplit(".", 1)[-1]
        assert lines[f.line - 1][f.col - 1:].startswith(f'"{key}"'), f


def test_one_wrong_type_does_not_hide_the_other_findings():
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "fp16": True,
              "zero_optimization": {"stage": "three", "overlap_com": True}, "expert_parallel": [1]}
    findings = lint.lint_config(config, world_size=8)
    types = {(f.path, f.message_id) for f in _by(findings, "config-value-type")}
    assert types == {("fp16", "not-object"), ("zero_optimization.stage", "not-integer"),
                     ("expert_parallel", "not-object")}
    assert _by(findings, "batch-arithmetic", "error") and _by(findings, "unknown-config-key")


def test_derived_accumulation_is_explained_not_printed_as_zero():
    """A Megatron-DeepSpeed-style config: train_batch_size 16, micro 4, on 8 ranks. DeepSpeed
    derives gradient_accumulation_steps = 16 // 4 // 8 = 0 and asserts it is > 0."""
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}
    [finding] = _by(lint.lint_config(config, world_size=8), "batch-arithmetic")
    assert finding.message_id == "accumulation-not-whole"
    assert "16 / (4 x 8) = 0.5" in finding.message and "* 0 *" not in finding.message
    assert finding.patch == {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    assert lint.lint_config(lint.merge_patch(config, finding.patch), world_size=8) == []


def test_misspelled_zero_key_is_an_error_like_deepspeed_says():
    """The same config made DeepSpeed raise in tests/fixtures/tracebacks/real_unknown_zero_key.txt."""
    assert "Extra inputs are not permitted" in (TRACEBACKS / "real_unknown_zero_key.txt").read_text()
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "overlap_com": True}}
    [finding] = _by(lint.lint_config(config), "unknown-config-key")
    assert finding.severity == "error" and finding.path == "zero_optimization.overlap_com"
    assert "'overlap_comm'" in finding.message
    assert finding.fix == "Rename 'zero_optimization.overlap_com' to 'overlap_comm'."  # the key in the fix
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


def test_keys_starting_with_underscore_are_comments():
    """DeepSpeed ignores unknown top-level keys, so "_comment" is harmless there (information);
    a pydantic-validated section refuses it (tests/test_knowledge_claims.py checks both)."""
    config = {"train_batch_size": 8, "_comment": "tuned for 8 x A100", "_author": {"name": "kim"},
              "zero_optimization": {"stage": 2, "_note": "bucket sizes from the seeds"}}
    found = {f.path: (f.severity, f.message_id) for f in _by(lint.lint_config(config), "unknown-config-key")}
    assert found == {"_comment": ("info", "comment"), "_author": ("info", "comment"),
                     "zero_optimization._note": ("error", "comment-refused")}
    assert not any("Did you mean" in f.message for f in lint.lint_config(config))


@pytest.mark.parametrize("key, value, guess", [
    ("comms_log", "verbose per-op timings", None),  # a comment string: comms_logger takes an object
    ("comms_log", {"enabled": True, "verbose": False}, "comms_logger"),
    ("sequence_parallel", {"size": 2}, None),  # DeepSpeed divides the world size by sequence_parallel_size
    ("sequence_paralel_size", 2, "sequence_parallel_size"),
    ("gradient_acumulation_steps", {"steps": 4}, None),
    ("wall_clock_breakdwn", {"enabled": True}, None),  # a boolean key
    ("wall_clock_breakdwn", True, "wall_clock_breakdown"),
])
def test_a_rename_is_proposed_only_when_deepspeed_accepts_the_renamed_config(key, value, guess):
    [finding] = _by(lint.lint_config({"train_batch_size": 8, key: value}), "unknown-config-key")
    if guess is None:
        assert "Did you mean" not in finding.message and finding.fix_id == "delete-key"
        assert finding.patch == {key: None}
    else:
        assert f"Did you mean '{guess}'?" in finding.message and finding.patch == {key: None, guess: value}


def test_a_rename_inside_a_validated_section_is_checked_by_its_model():
    typo = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "overlap_com": {"enabled": True}}}
    [finding] = _by(lint.lint_config(typo), "unknown-config-key")
    assert finding.severity == "error" and "Did you mean" not in finding.message  # overlap_comm is a bool
    bad_value = {"train_batch_size": 1, "zero_optimization": {"stagee": 7}}
    [finding] = _by(lint.lint_config(bad_value), "unknown-config-key")
    assert "Did you mean" not in finding.message  # DeepSpeedZeroConfig refuses stage 7


def test_lint_works_and_still_refuses_bad_renames_when_deepspeed_cannot_be_imported():
    """The harvested key types alone decide then (the schema comes from this session's cache)."""
    import os
    import subprocess
    import sys

    ds_schema.load_schema()  # make sure the session's cache holds the harvest
    code = ("import sys, json; sys.modules['deepspeed'] = None\n"
            "from troubleshooter import lint\n"
            "good = lint.lint_config({'train_batch_size': 8, 'wall_clock_breakdwn': True})\n"
            "bad = lint.lint_config({'train_batch_size': 8, 'comms_log': 'verbose'})\n"
            "print(json.dumps([[f.message for f in good], [f.message for f in bad], "
            "'deepspeed.runtime' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ}, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    good, bad, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Did you mean 'wall_clock_breakdown'?" in good[0] and "Did you mean" not in bad[0]
    assert not imported


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


@pytest.mark.parametrize("key, value, severity", [
    ("reduce_bucket_size", 1000, "warning"),
    ("reduce_bucket_size", 5e9, "warning"),
    ("reduce_bucket_size", 0, "error"),  # Field(gt=0)
    ("allgather_bucket_size", 0, "warning"),  # Field(ge=0): accepted, but tiny
    ("allgather_bucket_size", -1, "error"),
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
    assert finding.severity == "error" and "load_balance_coeff = 0.01" in finding.message
    assert _by(lint.lint_config(lint.merge_patch(config, finding.patch)), "autoep-load-balance-coeff") == []


def test_offload_param_below_stage3_is_a_warning():
    config = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    assert _by(lint.lint_config(config), "offload-last-resort", "warning")


@pytest.mark.parametrize("text, expected", [
    ('{"train_batch_size": 8,\n  "fp16": {"enabled": true,]}', r":2:28: invalid JSON \(and not hjson either"),
    ('[1, 2]', r":1:1: the config must be a JSON object, got array"),
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


def test_wrong_types_are_findings_with_position(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": "three"}, "fp16": true}')
    found = {(f.path, f.line, f.col, f.severity) for f in _by(lint.lint_path(path), "config-value-type")}
    assert found == {("zero_optimization.stage", 1, 24, "error"), ("fp16", 1, 43, "error")}


PUBLIC = Path(__file__).parent / "fixtures" / "public_configs"  # sources: SOURCES.md there


@pytest.mark.parametrize("name, consumer, expected", [
    # (file, the consumer that runs it, every non-info finding lint must give: all true)
    ("hf_ds_config_zero2.json", "hf", set()),
    ("hf_ds_config_zero3.json", "hf", set()),
    # LLaMA-Factory: overlap_comm off under stage 3, and two sections deepspeed 0.19.8 never reads
    ("llamafactory_ds_z3_config.json", "hf", {("warning", "zero3-overlap-comm", "zero_optimization.overlap_comm"),
                                               ("warning", "unknown-config-key", "comms_config"),
                                               ("warning", "unknown-config-key", "monitor_config")}),
    ("axolotl_zero3_bf16.json", "hf", set()),  # unprefixed stage-3 keys are DeepSpeed's own aliases
    ("deepspeed_autoep_zero1_qwen3_5_moe.json", "deepspeed", set()),
    ("deepspeed_zero3_leaf_qwen3_5.json", "deepspeed", set()),
])
def test_public_configs_have_no_false_errors_under_their_consumer(name, consumer, expected):
    findings = lint.lint_path(PUBLIC / name, world_size=8, consumer=consumer)
    assert {(f.severity, f.rule, f.path) for f in findings if f.severity != "info"} == expected
    assert all(f.line is not None for f in findings)


def test_public_configs_facts():
    """What the info findings say about the public configs, and that the HF templates are refused
    outside the HF Trainer (DeepSpeed cannot read their "auto")."""
    zero3 = lint.lint_path(PUBLIC / "hf_ds_config_zero3.json", consumer="hf")
    assert {(f.rule, f.message_id) for f in zero3} >= {("unknown-config-key", "deprecated-renamed")}
    axolotl = lint.lint_path(PUBLIC / "axolotl_zero3_bf16.json", consumer="hf")
    assert [(f.rule, f.path) for f in axolotl] == [
        ("gather-16bit-on-save", "zero_optimization.gather_16bit_weights_on_model_save")]
    for name in ("hf_ds_config_zero2.json", "llamafactory_ds_z3_config.json", "axolotl_zero3_bf16.json"):
        raw = lint.lint_path(PUBLIC / name, consumer="deepspeed")
        assert _by(raw, "hf-auto-value", "error") and _by(raw, "hf-auto-value", "error")[0].line


def test_non_string_keys_are_reported_not_a_crash():
    """A Python dict or YAML file can carry integer keys; DeepSpeed knows none of them."""
    top = lint.lint_config({1: 2, "train_batch_size": 8})
    nested = lint.lint_config({"zero_optimization": {3: "x", "stage": 3}})
    assert [(f.rule, f.path) for f in top] == [("unknown-config-key", "1")]
    assert [(f.rule, f.path) for f in nested] == [("unknown-config-key", "zero_optimization.3")]
