"""The knowledge base: schema, required entries, and that every pattern is exercised by real text.

Fixtures under tests/fixtures/tracebacks/ are real: ``real_*`` were captured by
tests/fixtures/make_tracebacks.py from failures provoked on this CPU stack, ``issue_*`` are
verbatim excerpts of public issues (their first line names the issue). Messages that cannot be
provoked here (GPU, NCCL, InfiniBand, a newer transformers) are in INLINE_SAMPLES; each is built
from the installed library's own message text or quotes a public report, as its comment says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_zeromoe import compat
from support.knowledge_scan import OWN_PATTERNS
from troubleshooter import knowledge

FIXTURES = Path(__file__).parent / "fixtures" / "tracebacks"
REQUIRED_IDS = {
    "cuda-oom", "cpu-oom", "nccl-watchdog-timeout", "nccl-timeout-env-ignored", "subgroup-timeout",
    "cuda-version-mismatch", "cuda-home-missing", "ninja-missing", "missing-compiler",
    "extension-build-error", "stale-extension-lock", "ds-build-ops-meaning", "native-moe-zero3",
    "moe-param-groups", "zero3-param-not-available", "zero3-inflight-params",
    "autoep-no-moe-layers", "autoep-top-k-undetermined", "autoep-transformers-5.23",
    "autoep-load-balance-coeff", "device-mismatch", "moe-config-block-ignored", "batch-arithmetic",
    "fp16-moe", "offload-last-resort", "zero3-overlap-comm", "ep-size-divisibility",
    "bucket-size-range", "gather-16bit-on-save", "router-collapse", "nccl-p2p-ib-disabled",
    "shm-too-small", "memlock-limit", "unknown-config-key",
}

#: Messages that cannot be provoked on this machine, with where each one's wording comes from.
INLINE_SAMPLES = {
    # transformers >= 5.23 with deepspeed 0.19.8: the measured symptom kept in compat.py.
    "autoep-transformers-5.23": [compat.KNOWN_BAD_COMBINATIONS[0].symptom],
    # NCCL's own log line (NCCL_DEBUG=INFO) for an environment override.
    "nccl-p2p-ib-disabled": ["host:1:1 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1."],
    # A launch script echoing its environment.
    "nccl-timeout-env-ignored": ["+ export NCCL_TIMEOUT=7200"],
    # GNU toolchain / setuptools wording.
    "missing-compiler": ["/bin/sh: 1: x86_64-linux-gnu-gcc: not found",
                         "error: command 'gcc' failed: No such file or directory",
                         "fatal error: Python.h: No such file or directory"],
    # DeepSpeed prints the user config at start-up; a seed-style block in it.
    "moe-config-block-ignored": ['json = {"moe": {"enable": true, "ep_size": 2}}'],
    # CPython's wording for DeepSpeedConfig(**section) with a non-object section (triggered for
    # real in tests/test_knowledge_claims.py::test_wrong_types_fail_inside_deepspeed).
    "config-value-type": ["TypeError: deepspeed.runtime.precision_config.DeepSpeedFP16Config() argument "
                          "after ** must be a mapping, not bool"],
    # The tail of the traceback of train_batch_size "auto" under deepspeed 0.19.8 (triggered for
    # real in tests/test_knowledge_claims.py::test_auto_values_under_raw_deepspeed_match_lints_classification).
    "hf-auto-value": ['  File "/x/site-packages/deepspeed/runtime/config.py", line 640, in _set_batch_related_parameters\n'
                      "    self.train_micro_batch_size_per_gpu = train_batch // self.world_size\n"
                      "                                          ~~~~~~~~~~~~^^~~~~~~~~~~~~~~~~\n"
                      "TypeError: unsupported operand type(s) for //: 'str' and 'int'"],
    # torch's DataLoader worker bus-error message (a string in libtorch_python).
    "shm-too-small": ["ERROR: Unexpected bus error encountered in worker. This might be caused by "
                      "insufficient shared memory (shm)."],
    # gloo's abort on a collective size mismatch (strings in libtorch_cpu; reproduced with two CPU
    # ranks all-gathering different sizes; tests/test_knowledge_claims.py reads the strings), next to
    # the ZeRO-3 frame that makes it this entry's (its context).
    "zero3-moe-gather-mismatch": [
        '  File "/x/site-packages/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 431, in '
        "__all_gather_params_\n"
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
        "/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 16 vs 8. "
        "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?"],
    # NCCL's wording (no CUDA build here; as public reports print it) inside DeepSpeed's MoE all-to-all.
    "nccl-all-to-all-error": [
        '  File "/x/site-packages/deepspeed/moe/sharded_moe.py", line 104, in forward\n'
        "    dist.all_to_all_single(output, input, group=group)\n"
        "torch.distributed.DistBackendError: NCCL error in: /x/ProcessGroupNCCL.cpp:3356, unhandled system "
        "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call failed"],
    # CPython's wording for a parameter ZeRO-3 never converted (triggered in test_knowledge_claims.py).
    "zero3-param-not-converted": ["AttributeError: 'Parameter' object has no attribute 'ds_numel'"],
    # A printed AutoEP counter (AutoEPMoELayer.tokens_per_expert) of a collapsed router.
    "router-collapse": ["tokens_per_expert: tensor([3907,   12,   40,   61])"],
    # A config path that is no file, as deepspeed.initialize (runtime/config.py) and Lightning's DeepSpeedStrategy
    # word it (tests/test_explain_evidence.py reads both strings from the installed sources).
    "config-file-format": ["ValueError: Expected a string path to an existing deepspeed config, or a dictionary or a "
                           "valid base64. Received: ds_config.json",
                           "You passed in a path to a DeepSpeed config but the path does not exist: ds_config.json"],
}


def _site_packages() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("rich").origin).parent.parent  # rich is light to locate


def _source_message(relpath: str, start: str, **values: str) -> str:
    """The string literal (in double quotes, else in single ones) containing ``start`` in an installed
    library's source, with its f-string placeholders filled from ``values`` (by expression text) or with "7"."""
    source = (_site_packages() / relpath).read_text()
    literal = next(hit.group(1) for quote in '"\'' if (hit := re.search(
        quote + "([^" + quote + "\\n]*" + re.escape(start) + "[^" + quote + "\\n]*)" + quote, source)))
    return re.sub(r"\{([^}]*)\}", lambda m: values.get(m.group(1), "7"), literal)


def _from_sources() -> dict[str, list[str]]:
    """Samples rebuilt from the installed deepspeed / torch sources (so the wording is theirs)."""
    return {
        "fp16-moe": [_source_message("deepspeed/runtime/fp16/loss_scaler.py", "[deepspeed] OVERFLOW! Rank")],
        "gather-16bit-on-save": [_source_message("deepspeed/runtime/engine.py", "Did not save the model")],
        "zero3-inflight-params": [_source_message("deepspeed/runtime/zero/partitioned_param_coordinator.py",
                                                  "Invalidate trace cache @ step {self.__step_id}: ")],
        "lightning-gradient-accumulation": [_source_message("lightning/pytorch/strategies/deepspeed.py",
                                                            "Do not set `gradient_accumulation_steps`")],
        "cuda-home-missing": [_source_message("deepspeed/ops/op_builder/builder.py", "Unable to run {nvcc}",
                                              nvcc="/usr/local/cuda/bin/nvcc"),
                              _source_message("torch/utils/cpp_extension.py", "CUDA_HOME environment variable")],
        "native-moe-gating-assert": [_source_message("deepspeed/moe/sharded_moe.py", "No. of tokens (batch-size)")],
        "ds-to-universal-mismatch": [_source_message("deepspeed/checkpoint/ds_to_universal.py",
                                                     "checkpoint model/optimizer rank sets do not match")],
        "autoep-frozen-experts": [_source_message("deepspeed/checkpoint/ds_to_universal.py",
                                                  "AutoEP frozen expert parameters cannot be converted")],
        # a bf16 run refused on a GPU without bf16, by each library that checks
        "gpu-without-bf16": [_source_message("torch/amp/autocast_mode.py", "does not support bfloat16"),
                             _source_message("transformers/training_args.py", "Your setup doesn't support bf16"),
                             _source_message("deepspeed/runtime/engine.py", "Type bf16 is not supported")],
    }


def _corpus() -> list[tuple[str, str]]:
    texts = [(p.name, p.read_text(errors="replace")) for p in sorted(FIXTURES.glob("*.txt"))]
    for entry_id, samples in {**INLINE_SAMPLES, **_from_sources()}.items():
        texts += [(f"inline:{entry_id}", s) for s in samples]
    return texts


def test_required_entries_exist_and_are_complete():
    entries = knowledge.load_entries()
    assert REQUIRED_IDS <= {e.id for e in entries}
    for e in entries:
        assert e.family in knowledge.FAMILIES and e.severity in knowledge.SEVERITIES
        assert e.title and e.cause and e.fix and e.symptoms and e.sources
        assert re.search(r"\d+\.\d+", e.checked_against), f"{e.id}: checked_against names no version"
        assert len(e.compiled) == len(e.patterns) == len(e.anchors)
        if e.patch_kind == "json":
            assert isinstance(e.patch_json(), dict)
        elif e.patch_kind == "diff":
            assert e.patch.lstrip().startswith("---")


def test_every_entry_with_patterns_is_matched_by_real_text():
    """OWN_PATTERNS are fed our real messages in tests/test_own_errors.py."""
    corpus = _corpus()
    matched = {m.entry.id for _, text in corpus for m in knowledge.match(text)}
    with_patterns = {e.id for e in knowledge.load_entries() if e.patterns or e.contextual}

    assert with_patterns - matched - OWN_PATTERNS == set()


def test_anchor_prefilter_never_hides_a_match():
    """Each pattern's anchor must occur in every text the bare regex matches."""
    for _, text in _corpus():
        lowered = text.lower()
        for e in knowledge.load_entries():
            pairs = (*zip(e.compiled, e.anchors), *zip(e.compiled_contextual, e.contextual_anchors),
                     *zip(e.compiled_context, e.context_anchors))
            for pattern, anchor in pairs:
                if pattern.search(text):
                    assert anchor in lowered, (e.id, pattern.pattern, anchor)


def test_compat_messages_are_recognised():
    """The strategy raises compat's wording; explain must recognise it."""
    for message in (compat.NATIVE_MOE_ZERO3_MESSAGE, f"AssertionError: {compat.LEGACY_MOE_ZERO3_MESSAGE}"):
        assert [m.entry.id for m in knowledge.match(message)] == ["native-moe-zero3"]


def test_minor_cuda_mismatch_that_deepspeed_accepts_is_not_flagged():
    accepted = ("Installed CUDA version 12.4 does not match the version torch was compiled with 12.1 "
                "but since the APIs are compatible, accepting this combination")
    assert "cuda-version-mismatch" not in {m.entry.id for m in knowledge.match(accepted)}
    refused = accepted.split(" but since")[0].replace("12.4", "11.8") + ", unable to compile"
    assert "cuda-version-mismatch" in {m.entry.id for m in knowledge.match(refused)}


def test_torch_cuda_mismatch_message_from_torch_source():
    source = (_site_packages() / "torch/utils/cpp_extension.py").read_text()
    block = re.search(r"CUDA_MISMATCH_MESSAGE = \(\s*((?:\"[^\"]*\"\s*)+)\)", source).group(1)
    message = "".join(re.findall(r'"([^"]*)"', block)) % ("12.0", "11.8")
    hits = knowledge.match(f"RuntimeError: {message}")
    assert hits[0].entry.id == "cuda-version-mismatch"
    assert hits[0].details == {"system": "12.0", "torch": "11.8"}


def test_get_unknown_id_suggests_close_ids():
    assert knowledge.get("cuda-oom").id == "cuda-oom"
    with pytest.raises(KeyError, match="cuda-oom"):
        knowledge.get("cuda-om")


def _write_entry(tmp_path: Path, name: str, **changes) -> Path:
    fields = {
        "id": name, "title": "t", "family": "config", "severity": "info",
        "checked_against": "deepspeed 0.19.8", "symptoms": ["s"], "patterns": ["abc"],
        "cause": "c", "sources": ["x"], "fixes": [{"id": "f", "text": "do f"}],
    }
    fields.update(changes)
    lines, tables = [], []
    for key, value in fields.items():
        if key == "fixes":
            tables += ["[[fixes]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in item.items()) for item in value]
        elif value is not None:
            lines.append(f"{key} = {json.dumps(value)}")
    lines += tables
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("changes, field", [
    ({"family": "gpu"}, "family"),
    ({"severity": "fatal"}, "severity"),
    ({"cause": None}, "cause"),
    ({"fixes": []}, "fixes"),
    ({"fixes": [{"id": "Bad Id", "text": "t"}]}, "fixes"),
    ({"fixes": [{"id": "a", "text": "t"}, {"id": "a", "text": "u"}]}, "fixes"),
    ({"fixes": [{"id": "a", "text": "t", "extra": 1}]}, "fixes"),
    ({"fix": ["old list form"]}, "fix"),
    ({"patterns": ["(unclosed"]}, "patterns"),
    ({"patch": "{not json", "patch_kind": "json"}, "patch"),
    ({"patch": "{}"}, "patch_kind"),
    ({"id": "other"}, "id"),
    ({"colour": "red"}, "colour"),
    ({"contextual": ["abc"]}, "context"),
    ({"contextual": ["(unclosed"], "context": ["x"]}, "contextual"),
    ({"contextual": ["abc"], "context": ["x"], "context_chars": 0}, "context_chars"),
    ({"fixes": [{"id": "a", "text": "t", "skip_when": "x"}]}, "fixes"),
    ({"fixes": [{"id": "a", "text": "t", "skip_when": "(", "skip_why": "w"}]}, "fixes"),
    ({"fixes": [{"id": "a", "text": "t", "skip_on": ["stack:^windows$"]}]}, "fixes"),
    ({"fixes": [{"id": "a", "text": "t", "skip_on": ["colour:red"], "skip_why": "w"}]}, "fixes.skip_on"),
])
def test_schema_violations_name_file_and_field(tmp_path, changes, field):
    path = _write_entry(tmp_path, "bad-entry", **changes)
    with pytest.raises(knowledge.KnowledgeError, match=rf"bad-entry\.toml: field '{field}'"):
        knowledge.load_entry(path)


def test_contextual_patterns_count_only_near_their_context():
    """zero3-param-not-available: a shape error with a size-0 operand is that entry's only within
    context_chars of a ZeRO-3 frame or config, before or after it."""
    error = "RuntimeError: The size of tensor a (0) must match the size of tensor b (4096) at non-singleton dimension 1\n"
    frame = '  File "/x/site-packages/deepspeed/runtime/zero/stage3.py", line 2270, in backward\n'
    entry = knowledge.get("zero3-param-not-available")
    far = "x" * (entry.context_chars + 100) + "\n"

    def found(text: str) -> bool:
        return "zero3-param-not-available" in {m.entry.id for m in knowledge.match(text)}
    assert found(frame + error) and found(error + "my config: {\"zero_optimization\": {\"stage\": 3}}\n")
    assert not found(error) and not found(frame + far + error)


def test_every_fix_explain_can_show_has_identifier_placeholders_only():
    """A fix text with braces that are no placeholder (JSON) would be dropped by explain."""
    for e in knowledge.load_entries():
        for f in e.fixes:
            names = f.placeholders()
            assert all(n.isidentifier() for n in names) or (e.id, f.id) == ("moe-param-groups", "split-moe-groups"), \
                (e.id, f.id, names)


def test_match_ranks_cause_before_timeout_echo():
    """An OOM on one rank makes the others time out: the OOM must come first."""
    oom = (FIXTURES / "issue_cuda_oom_new_format.txt").read_text()
    timeout = (FIXTURES / "issue_nccl_watchdog_new.txt").read_text()
    ranked = [m.entry.id for m in knowledge.match(oom + timeout)]
    assert ranked[:2] == ["cuda-oom", "nccl-watchdog-timeout"]
