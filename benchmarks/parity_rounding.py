"""Is a loss gap to the plain run a change of the math, or rounding that AdamW amplifies?

``ZeroMoEStrategy(ep_size=E)`` on 2 CPU ranks (ZeRO-3; gloo) trains a Mixtral-style or Qwen3-MoE-style
model (hidden 256, 4 layers, 8 experts top-2, expert intermediate 1024, vocab 1024, saved with
``save_pretrained`` and loaded in ``configure_model``), 10 steps of a global batch of 8 x 64 random
tokens (seed ``--data-seed``), each rank 4 sequences by ``DistributedSampler(shuffle=False)``. Rank 0 then
trains two plain single-process runs on the same global batches:

* **plain**: each global batch in one forward;
* **plain, rows reordered**: each global batch in one forward, its rows in the order the two ranks hold
  them (rank 0's half, then rank 1's): the same mean over the same rows, summed in another order;
* **plain, two halves**: each global batch as the two ranks' halves, their losses averaged: the same
  mathematics again, summed as data parallelism sums it.

Each prints its per-step loss difference to the plain run. With ``--optimizer adamw`` (lr 1e-3, no weight
decay) runs that differ only in the order of their sums can drift apart as far as a distributed run
drifts from the plain one: AdamW divides each update by
the root of its second moment, so a gradient element near zero whose last bits differ gets a full-size
step of another sign, and a top-k router decides on scores that then differ. With ``--optimizer sgd``
(lr 0.5) updates are proportional to the gradients, so rounding stays rounding: a change of the math
would show here as a gap above ~1e-6.

    .venv/bin/python benchmarks/parity_rounding.py --model qwen3_moe --ep 1 --optimizer adamw
    .venv/bin/python benchmarks/parity_rounding.py --model qwen3_moe --ep 2 --optimizer sgd

One launch takes about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS, GLOBAL, SEQ = 10, 8, 64

WORKER = r'''
import os, sys, torch, transformers
import lightning as L
from torch.utils.data import DataLoader, DistributedSampler
from lightning_zeromoe import ZeroMoEStrategy
path, ep, optimizer, seed, steps, glob, seq = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
data = torch.randint(0, 1024, (glob * steps, seq), generator=torch.Generator().manual_seed(seed))
def make_optimizer(params):
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
class Module(L.LightningModule):
    def __init__(self):
        super().__init__(); self.model = None; self.losses = []
    def configure_model(self):
        if self.model is None:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path); self.model.train()
    def train_dataloader(self):
        sampler = DistributedSampler(data, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=glob // self.trainer.world_size, sampler=sampler)
    def training_step(self, batch):
        loss = self.model(input_ids=batch, labels=batch).loss
        mean = loss.detach().clone(); torch.distributed.all_reduce(mean)
        self.losses.append(mean.item() / self.trainer.world_size)
        return loss
    def configure_optimizers(self):
        return make_optimizer(self.parameters())
module = Module()
trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                    strategy=ZeroMoEStrategy(ep_size=ep))
trainer.fit(module)
if trainer.global_rank == 0:
    def plain(order):
        model = transformers.AutoModelForCausalLM.from_pretrained(path); model.train()
        opt, losses = make_optimizer(model.parameters()), []
        for step in range(steps):
            rows = data[glob * step:glob * (step + 1)]
            halves = [rows[0::2], rows[1::2]]  # the ranks' halves, as the sampler splits them
            parts = {"one": [rows], "reordered": [torch.cat(halves)], "halves": halves}[order]
            loss = sum(model(input_ids=p, labels=p).loss for p in parts) / len(parts)
            loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.item())
        return losses
    one = plain("one")
    gap = lambda a, b: " ".join(f"{abs(x - y):.1e}" for x, y in zip(a, b))
    print(f"strategy vs plain:               {gap(module.losses, one)}")
    print(f"plain, rows reordered vs plain:  {gap(plain('reordered'), one)}")
    print(f"plain, two halves vs plain:      {gap(plain('halves'), one)}", flush=True)
'''


def save_model(family: str, directory: Path) -> None:
    """The benchmark's model: ``native_peer.py``'s (hidden 256, expert intermediate 1024), saved."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from native_peer import build_model

    build_model(family, 256, 1024).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mixtral", "qwen3_moe"), default="qwen3_moe")
    parser.add_argument("--ep", type=int, default=1, choices=(1, 2))
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29691)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, worker = Path(tmp) / args.model, Path(tmp) / "worker.py"
        save_model(args.model, model)
        worker.write_text(WORKER)
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(args.port), str(worker), str(model), str(args.ep), args.optimizer,
                               str(args.data_seed), str(STEPS), str(GLOBAL), str(SEQ)],
                              env=env, capture_output=True, text=True, timeout=900, cwd=tmp)
        lines = [line for line in done.stdout.splitlines() if " vs plain" in line]
        if done.returncode != 0 or len(lines) != 3:
            raise SystemExit(f"launch failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    print(f"{args.model}, ep_size={args.ep}, {args.optimizer}, data seed {args.data_seed}: "
          f"|loss difference| per step, steps 1-{STEPS}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
