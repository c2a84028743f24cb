"""The knowledge base is the only place advice lives, and every citation of it resolves.

Static (AST) scan of the whole ``troubleshooter`` package (tests/support/knowledge_scan.py): every call
of the citation API names an existing entry and an existing fix / message id, and no string
literal outside ``troubleshooter/knowledge/`` holds fix prose. Then lint is run for real on
configs that trigger every message template it cites, so every template renders with the values
lint passes (a missing placeholder raises KeyError).
"""

from __future__ import annotations

import textwrap

import pytest

from support import knowledge_scan as scan
from troubleshooter import knowledge, lint

#: Files exempt from the prose check (their citations are still checked). Empty: the doctor and
#: the walkthroughs cite the knowledge base like everything else. Nothing may be added to it.
PENDING: set[str] = set()


def _pending(path: str) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in PENDING)


def _known_texts() -> list[str]:
    return [t.text for e in knowledge.load_entries() for t in (*e.fixes, *e.messages)]


def _all_citations() -> list[scan.Citation]:
    return [c for path in scan.python_files() for c in scan.citations(path)]


def test_every_citation_names_an_existing_entry_and_id():
    cites = _all_citations()
    assert len(cites) >= 50  # lint alone cites ~60 templates: the scan sees them
    problems = []
    for c in cites:
        if c.unresolved:
            problems.append(f"{c.path}:{c.line}: {c.kind} citation with ids not known statically")
            continue
        for entry_id in c.entries:
            try:
                entry = knowledge.get(entry_id)
            except KeyError as err:
                problems.append(f"{c.path}:{c.line}: {err}")
                continue
            for item_id in c.ids:
                try:
                    (entry.get_fix if c.kind == "fix" else entry.get_message)(item_id)
                except KeyError as err:
                    problems.append(f"{c.path}:{c.line}: {err}")
    assert problems == []


def test_no_advice_prose_outside_the_knowledge_base():
    texts = _known_texts()
    found = [f"{p.path}:{p.line}: {p.why}: {p.text[:80]!r}"
             for path in scan.python_files() for p in scan.prose(path, texts) if not _pending(p.path)]
    assert found == []


def test_pending_exemptions_are_only_the_branches_being_converted():
    mine = {"troubleshooter/lint/", "troubleshooter/cli.py", "troubleshooter/render.py",
            "troubleshooter/argtypes.py", "troubleshooter/ds_schema.py", "troubleshooter/explain.py"}
    assert not any(_pending(m) for m in mine)
    assert PENDING == set()


def test_the_scan_catches_hand_written_advice_and_bad_citations(tmp_path):
    """The enforcement can fail: a module with every kind of violation is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent('''
        """Docstrings may say: Set anything you like."""
        from troubleshooter import knowledge
        from troubleshooter.knowledge import fix as cite

        NOTES = {"a": "note-enabled", "b": "no-such-note"}

        def f(check, key, parser):
            parser.add_argument("--x", help="Use this to pick the thing")  # help: documentation
            check(fix="Lower the micro batch size.")
            msg = f"{key} is wrong. Rename it to 'enabled'."
            knowledge.fix("cuda-oom", "no-such-fix")
            cite("no-such-entry", "x")
            knowledge.message("moe-config-block-ignored", NOTES.get(key, "note-unknown"))
            knowledge.fix("cuda-oom", key)
            copy = "Measure first: log torch.cuda.max_memory_allocated() per step"
            return msg, copy
    '''))
    texts = _known_texts()
    prose = {(p.line, p.why) for p in scan.prose(bad, texts)}
    assert prose == {(10, "a hand-written fix= string"), (11, "an imperative fix sentence"),
                     (16, "a copy of a knowledge-base text")}
    cites = {c.line: c for c in scan.citations(bad)}
    assert cites[12].ids == ("no-such-fix",) and cites[13].entries == ("no-such-entry",)
    assert set(cites[14].ids) == {"note-enabled", "no-such-note", "note-unknown"}
    assert cites[15].unresolved
    with pytest.raises(KeyError, match="no-such-note"):
        knowledge.get("moe-config-block-ignored").get_message("no-such-note")


#: Configs that, together, make lint use every message template it cites.
CORPUS: list[tuple[dict, dict]] = [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, {"world_size": 8}),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 32}, {"world_size": 1}),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     {"world_size": 4}),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, {}),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, {}),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, {}),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, {"consumer": "lightning"}),
    ({"train_batch_size": "auto", "gradient_clipping": "auto", "fp16": {"enabled": "auto"}}, {}),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 3},
      "expert_parallel": {"enabled": True, "autoep_size": 3, "load_balance_coeff": 0.1}}, {"world_size": 8}),
    ({"fp16": True, "zero_optimization": {"stage": "three"}}, {}),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu", "pin_memory": True},
                            "offload_optimizer": {"device": "cpu"}, "overlap_com": True,
                            "reduce_bucket_size": 0, "allgather_bucket_size": 10,
                            "stage3_prefetch_bucket_size": 0, "cpu_offload": True}}, {}),
    ({"zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 5e9,
                            "stage3_gather_16bit_weights_on_model_save": True, "zzz_unknown": 1},
      "amp": {"enabled": True}, "zzzz": 1, "gradient_acumulation_steps": 2}, {}),
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
      "expert_parallel": {"enabled": True}}, {}),
    ({"aio": {"thread_count": 1}, "moe": {"enabled": True, "ep_size": 2, "k": 2, "capacity_factor": 1,
                                          "drop_tokens": False, "noisy_gate_policy": "Jitter",
                                          "load_balance_loss_weight": 0.1, "use_tutel": False,
                                          "num_experts": 8, "bogus": 1}}, {}),
    ({"zero_optimization": {"stage": 3}, "moe": {"enabled": True}}, {}),
    ({"fp16": {"enabled": True}, "_comment": "x", "zero_optimization": {"stage": 2, "_note": "y"},
      "moe": {"enabled": True, "ep_size": 3, "num_experts": 8}}, {"world_size": 8}),
]


def test_every_message_lint_cites_is_produced_and_renders(tmp_path):
    lint_dir = scan.PACKAGE / "lint"
    cited = {(e, m) for path in sorted(lint_dir.glob("*.py")) for c in scan.citations(path)
             if c.kind == "message" for e in c.entries for m in c.ids}
    produced: set[tuple[str, str]] = set()
    for config, kwargs in CORPUS:
        for f in lint.lint_config(config, **kwargs):
            produced.add((f.rule, f.message_id))
            produced |= {(f.rule, n) for n in f.note_ids}
            assert "{" not in f.message.replace("{\"", "") and f.fix, f
    hjson_file = tmp_path / "ds.json"
    hjson_file.write_text('{\n  // comment\n  "train_batch_size": 8,\n}\n')
    for consumer in lint.CONSUMERS:
        produced |= {(f.rule, f.message_id) for f in lint.lint_path(hjson_file, consumer=consumer)}
    moe_notes = {("moe-config-block-ignored", m.id) for m in knowledge.get("moe-config-block-ignored").messages}
    # Not reachable with the installed DeepSpeed: its schema always harvests (no
    # "schema-unavailable"), and every key it deprecates has a replacement (no bare "deprecated").
    unreachable = {("unknown-config-key", "schema-unavailable"), ("unknown-config-key", "deprecated")}
    assert cited - produced - unreachable == set()
    assert moe_notes - cited == set()  # every per-key note of the entry is reachable
