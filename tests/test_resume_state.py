"""A resume on another shape restores the whole model state, not only what the optimizer owns.

One real 2-rank ``torchrun`` launch of ``tests/jobs/resume_state.py`` (DeepSpeed engines, gloo): a
tiny DeepSeek-V3 with non-zero ``e_score_correction_bias`` routing buffers and a LightningModule
buffer of its own is trained and saved, then resumed by a model built with *other* initial values
whose embedding is now frozen. Three cases: ``ep_size`` 2 -> 1, 1 -> 2, and ``ep_size=1`` with the
config's ``expert_parallel.autoep_size: 2`` on both sides (the engine runs EP 2: the resume must
see that shape, not the keyword's). The reference for every tensor of the network is what
``zeromoe-export`` wrote from the checkpoint, under the model's own names.

Before this was fixed, the buffers kept their initial values (DeepSpeed's universal load skips the
module state dict), silently changing which experts every token is routed to.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.jobs import JOBS, REPO, free_port, job_env

CASES = ("2to1", "1to2", "c2toc2")
BIAS = "e_score_correction_bias"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("resume_state")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(JOBS / "resume_state.py"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out, proc.stdout + proc.stderr


def _own(name: str) -> str:
    """The engine's name -> the exported model's (AutoEP's router keeps DeepSeek-V3's gate bias)."""
    return name.removeprefix("net.").replace(f".router.{BIAS}", f".gate.{BIAS}")


@pytest.mark.parametrize("case", CASES)
def test_buffers_and_newly_frozen_parameters_come_from_the_checkpoint(resumed, case):
    out, _ = resumed
    reference = load_file(out / case / "reference.safetensors")
    tokens_seen = json.loads((out / case / "source.json").read_text())["tokens_seen"]
    for rank in (0, 1):
        state = torch.load(out / case / "resumed" / f"rank{rank}.pt")
        biases = {n: b for n, b in state["buffers"].items() if n.endswith(BIAS)}
        assert len(biases) == 2, state["buffers"].keys()
        for name, value in biases.items():
            assert torch.equal(value, reference[_own(name)]), f"{case} rank {rank}: {name} is not the saved bias"
        assert int(state["buffers"]["tokens_seen"]) == tokens_seen > 0
        # Non-persistent: not in any checkpoint; it keeps what the model built.
        assert torch.equal(state["buffers"]["scratch"], torch.full((3,), 7.0))
        frozen = state["frozen"]["net.model.embed_tokens.weight"]
        assert torch.equal(frozen, reference["model.embed_tokens.weight"]), f"{case} rank {rank}: embedding"


def test_the_resumed_model_was_built_with_other_values():
    """The comparison above can fail: seed 1 builds other routing biases and embeddings."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.hf_zoo import build

    first, second = dict(build("deepseek_v3", seed=0).named_buffers()), dict(build("deepseek_v3", seed=1).named_buffers())
    name = next(n for n in first if n.endswith(BIAS))
    assert not torch.equal(first[name], second[name])


def test_the_resume_line_counts_what_was_restored_on_the_shape_the_engine_runs(resumed):
    out, log = resumed
    lines = [line for line in log.splitlines() if "ZeroMoEStrategy: resumed" in line]
    assert len(lines) == len(CASES), lines
    for line in lines:
        assert "3 buffer(s), 1 frozen tensor(s) restored" in line, line
    config_line = next(line for line in lines if "c2toc2" in line)
    assert "(2 ranks, ep_size=2, ZeRO stage 3) on 2 ranks, ep_size=2" in config_line, config_line
    assert "holds no value" not in log
