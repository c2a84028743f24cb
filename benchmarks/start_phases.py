"""Where a ``ZeroMoEStrategy`` run's start-up time and memory go, phase by phase, for two checkouts.

The run is a user's: a Mixtral-style model saved with ``save_pretrained`` (hidden 256, 4 layers, 8
experts top-2, intermediate 512, vocab 1024: 14 M parameters), loaded with ``from_pretrained`` in
``configure_model``, trained with ``ZeroMoEStrategy(ep_size=2)`` (ZeRO-3, AutoEP) on 2 CPU ranks
(gloo), fp32, torch's AdamW, micro-batch 4 x 128 tokens per rank, 12 steps (3 warm-up). Each rank
records its resident set size (RSS, ``psutil``) and the time since launch at each phase boundary:

* ``imports``: torch, lightning, transformers and lightning_zeromoe imported (the library baseline);
* ``configure_model``: the process group and the Trainer are up, the model is not loaded yet;
* ``loaded``: ``from_pretrained`` has built the model (partitioned, under ``zero.Init``);
* ``probe``: around the conversion probe (:func:`lightning_zeromoe.conversion.prove.prove`);
* ``initialize``: around :func:`lightning_zeromoe.engine.build.initialize` (``deepspeed.initialize``);
* ``engine built``: at ``on_train_start``;
* the first step (forward, backward, optimizer step) and the peak (``ru_maxrss``) at the end.

``--code`` names the checkouts whose ``lightning_zeromoe`` the runs import; the runs alternate between
them, ``--repeats`` times, and the table gives the median per checkout and phase (both ranks, all
repeats). A before/after comparison is one invocation on one machine::

    git worktree add /tmp/before <rev>      # or: git archive <rev> | tar -x -C /tmp/before
    .venv/bin/python benchmarks/start_phases.py --code /tmp/before . --repeats 3

CPU ranks over gloo: the times are a 2-core machine's; the RSS phases are what the code allocates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: One rank of a run (written to a file and started by torchrun).
WORKER = r'''
import json, os, resource, sys, time
import psutil
T0 = time.time()
def rss(): return psutil.Process().memory_info().rss / 2**20
marks = {}
def mark(name, t=None): marks[name] = round(rss(), 1); marks["t " + name] = round(time.time() - T0 if t is None else t, 2)
import torch, lightning as L
from transformers import AutoModelForCausalLM
from lightning_zeromoe import ZeroMoEStrategy
import lightning_zeromoe.conversion.prove as prove_module, lightning_zeromoe.strategy as strategy_module
mark("imports")
def around(module, name, tag):
    original = getattr(module, name)
    def timed(*args, **kwargs):
        mark(tag + " in")
        try:
            return original(*args, **kwargs)
        finally:
            mark(tag + " out")
    setattr(module, name, timed)
around(prove_module, "prove", "probe")
around(strategy_module, "initialize", "initialize")
MODEL, STEPS, WARM, BATCH, SEQ = sys.argv[1], 12, 3, 4, 128
class Module(L.LightningModule):
    def __init__(self):
        super().__init__(); self.model = None; self.ends = []
    def configure_model(self):
        if self.model is None:
            mark("configure_model")
            self.model = AutoModelForCausalLM.from_pretrained(MODEL); self.model.train()
            mark("loaded")
    def on_train_start(self): mark("engine built")
    def training_step(self, batch):
        if not self.ends: mark("step 1 forward in")
        return self.model(input_ids=batch, labels=batch).loss
    def on_before_backward(self, loss):
        if not self.ends: mark("step 1 backward in")
    def on_after_backward(self):
        if not self.ends: mark("step 1 optimizer in")
    def on_train_batch_end(self, *args):
        self.ends.append(time.time())
        if len(self.ends) == 1: mark("step 1 end")
    def configure_optimizers(self): return torch.optim.AdamW(self.parameters(), lr=1e-3)
data = torch.randint(0, 1024, (2 * BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(0))
module = Module()
trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, strategy=ZeroMoEStrategy(ep_size=2))
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
marks["peak"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
ends = module.ends
marks["tokens/s"] = round(2 * BATCH * SEQ * (len(ends) - WARM) / (ends[-1] - ends[WARM - 1]), 1)
print("PHASES " + json.dumps(marks), flush=True)
'''

#: The rows of the table: (label, RSS mark, time mark or None).
ROWS = (("library imports", "imports"), ("before configure_model", "configure_model"),
        ("model loaded", "loaded"), ("conversion probe: in", "probe in"), ("conversion probe: out", "probe out"),
        ("deepspeed.initialize: in", "initialize in"), ("deepspeed.initialize: out", "initialize out"),
        ("engine built", "engine built"), ("step 1: forward done", "step 1 backward in"),
        ("step 1: backward done", "step 1 optimizer in"), ("step 1: optimizer done", "step 1 end"))


def save_model(directory: Path) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=1024,
                           max_position_embeddings=256)
    MixtralForCausalLM(config).save_pretrained(directory)


def run(code: Path, worker: Path, model: Path, port: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(port), str(worker), str(model)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=worker.parent)
    found = [json.loads(line.split("PHASES ", 1)[1]) for line in done.stdout.splitlines() if "PHASES " in line]
    if done.returncode != 0 or len(found) != 2:
        raise SystemExit(f"run with {code} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, nargs="+", default=[REPO], help="checkouts to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument("--json", type=Path, help="write every rank's marks here")
    args = parser.parse_args()
    codes = [c.resolve() for c in args.code]
    results: dict[Path, list[dict]] = {c: [] for c in codes}
    with tempfile.TemporaryDirectory() as tmp:
        model, worker = Path(tmp) / "mixtral", Path(tmp) / "worker.py"
        save_model(model)
        worker.write_text(WORKER)
        for repeat in range(args.repeats):
            for code in codes if repeat % 2 == 0 else codes[::-1]:
                results[code] += run(code, worker, model, args.port)
                print(f"repeat {repeat + 1}: {code} done", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({str(c): r for c, r in results.items()}, indent=1))
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in results.items()}
    print(f"medians over {args.repeats} repeats x 2 ranks; RSS in MB, time in s since launch")
    print("| phase | " + " | ".join(f"{c.name} RSS | {c.name} t" for c in codes) + " |")
    print("|---|" + "---:|---:|" * len(codes))
    for label, key in ROWS:
        print(f"| {label} | " + " | ".join(f"{med[c][key]:.0f} | {med[c]['t ' + key]:.1f}" for c in codes) + " |")
    for label, key in (("peak RSS (ru_maxrss)", "peak"), ("peak minus library imports", None),
                       ("tokens/s (steps 4-12, both ranks)", "tokens/s")):
        cells = [med[c][key] if key else med[c]["peak"] - med[c]["imports"] for c in codes]
        print(f"| {label} | " + " | ".join(f"{v:.0f} | " for v in cells) + " |")


if __name__ == "__main__":
    main()
