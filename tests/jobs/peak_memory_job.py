"""Peak resident memory per rank during the first and a steady training step, under ZeroMoEStrategy.

Launched with torchrun (the script becomes its own launcher when ``LOCAL_RANK`` is unset), so one
process group can run several cases one after another, each a fresh ``Trainer.fit`` of the tiny
MoE LM (fp32, CPU, gloo) with the strategy's own bucket and threshold settings:

    python tests/jobs/peak_memory_job.py --out DIR --world 2 --cases 3:1,3:2,2:2,1:2

Each case writes, per rank, bytes over the baseline:

* ``baseline``: ``RssAnon`` in the ``setup`` hook (process group up, engine not built) minus the
  bytes of the model's tensors, built whole in the LightningModule's ``__init__`` (a model built
  under ``zero.Init`` in ``configure_model`` would skip its own initialisation), taken after a
  warm-up step of a throwaway model (so the first measured step does not page in torch's kernels)
  and ``malloc_trim``. Anonymous memory only: file pages (shared libraries) are not what a
  device would hold.
* ``held_<step>``: anonymous memory just before that step;
* ``forward_<step>``, ``backward_<step>``, ``step_<step>``: the kernel's high-water mark of the
  resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` at each mark: exact, no sampling)
  from the start of the step to ``on_before_backward``, to ``on_after_backward``, and to the end of
  the optimizer step, minus the file and shared pages resident at that mark; ``peak_<step>`` is their
  maximum.
* ``new_modules_<step>``: modules imported since the baseline (the warm-up imports the ones the first
  engine build would, ~45 MB; what is left shows here). ``PEAK_DEBUG=1`` adds the largest live
  tensors, the module names, and the resident set at each layer's forward and backward.

The allocator: glibc is run with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``, set before the
ranks start), so every tensor over 64 KiB is its own mapping, returned to the system when freed.
With the default adaptive threshold, freed tensors of up to 32 MB stay in the heap and the resident
set reflects the heap's history, not what is alive; a GPU's caching allocator has its own such
slack, which the planner's headroom covers. Pages are resident only once written: a buffer that is
allocated but only partly written counts for the part written (see ``planner.working_set``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

#: Mixtral-like, MoE-dominated: 8 experts x 3 x 256 x 512 per layer (12.6 MB fp32), 4 layers.
MODEL = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_experts=8, top_k=2,
             ffn_hidden_size=512, max_seq_len=128)
MICRO_BATCH = 4
#: Sequence length the module trains on (TinyMoEModule: max_seq_len // 2 inputs).
SEQ_LEN = MODEL["max_seq_len"] // 2
#: The strategy audits gradients for its first 3 optimizer steps; the steady step comes after.
FIRST, STEADY = 0, 4
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


#: Imported lazily during the first engine build (torch.compile's stack, AutoEP, networkx): ~45 MB
#: of Python objects, once per process, which would count against the first case's model.
LAZY_IMPORTS = ("networkx", "functorch.compile", "torch._inductor.compile_fx", "torch.export",
                "deepspeed.module_inject", "deepspeed.moe.layer", "deepspeed.runtime.zero.stage3",
                "deepspeed.runtime.zero.stage_1_and_2", "lightning_zeromoe.conversion.check")


def _warm_up() -> None:
    """One forward, backward and AdamW step of a small copy of the model, then freed; the imports
    the engine build makes once per process, made now."""
    import importlib

    import torch

    for name in LAZY_IMPORTS:
        importlib.import_module(name)

    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM, lm_losses

    model = TinyMoELM(TinyMoEConfig(**dict(MODEL, hidden_size=32, ffn_hidden_size=32, num_layers=1)))
    opt = torch.optim.AdamW(model.parameters())
    task, aux = lm_losses(model, torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, SEQ_LEN + 1)))
    (task.mean() + aux.mean()).backward()
    opt.step()
    del model, opt, task, aux


def _live_tensors() -> list:
    """Debugging aid (PEAK_DEBUG=1): the largest tensor storages Python can reach, by size."""
    import torch

    storages: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                storages[st.data_ptr()] = (st.nbytes(), f"{type(obj).__name__}{tuple(obj.shape)}")
        except Exception:  # noqa: BLE001 - some tensors (meta, sparse) have no storage
            continue
    return sorted(storages.values(), reverse=True)[:40] + [("total", sum(n for n, _ in storages.values()))]


def _probe_class():
    import lightning as L

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.record: dict[str, int] = {}

        def setup(self, trainer, pl_module, stage) -> None:
            _warm_up()
            _trim()
            model = sum(t.numel() * t.element_size() for t in (*pl_module.parameters(), *pl_module.buffers()))
            self.record["model_bytes"] = model
            self.record["baseline"] = _status()["RssAnon"] - model
            self.setup_modules()

        def on_train_start(self, trainer, pl_module) -> None:
            if not os.environ.get("PEAK_DEBUG"):
                return
            self.record["trace"] = []

            def mark(label):
                def hook(*_):
                    if self.batch == FIRST:
                        st = _status()
                        self.record["trace"].append((label, st["RssAnon"] - self.record["baseline"],
                                                     st["VmHWM"] - st["RssFile"] - self.record["baseline"]))
                return hook

            for name, module in trainer.strategy.deepspeed_engine.module.named_modules():
                if name.endswith(("mlp", "attn", "lm_head")):
                    module.register_full_backward_pre_hook(mark(f"{name} backward start"))
                    module.register_full_backward_hook(mark(f"{name} backward end"))
                    module.register_forward_hook(mark(f"{name} forward end"))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batch = batch_idx
            if batch_idx in (FIRST, STEADY):
                _trim()
                self.record[f"held_{batch_idx}"] = _status()["RssAnon"] - self.record["baseline"]
                self.record[f"new_modules_{batch_idx}"] = len(set(sys.modules) - self.modules)
                if os.environ.get("PEAK_DEBUG"):
                    self.record[f"tensors_{batch_idx}"] = _live_tensors()
                    self.record[f"modules_{batch_idx}"] = sorted(set(sys.modules) - self.modules)
                self._reset()

        def setup_modules(self) -> None:
            self.modules = set(sys.modules)

        def _reset(self) -> None:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS

        def _segment(self, name: str) -> None:
            """The peak since the last mark, per phase of the step: exact, from VmHWM."""
            if self.batch in (FIRST, STEADY):
                s = _status()
                self.record[f"{name}_{self.batch}"] = s["VmHWM"] - s["RssFile"] - s["RssShmem"] - self.record["baseline"]
                self._reset()

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._segment("forward")

        def on_after_backward(self, trainer, pl_module) -> None:
            self._segment("backward")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx in (FIRST, STEADY):
                self._segment("step")
                s = _status()
                self.record[f"peak_{batch_idx}"] = max(self.record[f"{k}_{batch_idx}"]
                                                       for k in ("forward", "backward", "step"))
                self.record[f"after_{batch_idx}"] = s["RssAnon"] - self.record["baseline"]

    return Probe


def run_case(stage: int, ep_size: int, world: int) -> dict:
    import lightning as L

    from lightning_zeromoe import ZeroMoEStrategy
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

    L.seed_everything(0, verbose=False)
    probe = _probe_class()()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEADY + 1, logger=False, precision="32-true",
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        strategy=ZeroMoEStrategy(stage=stage, ep_size=ep_size), callbacks=[probe])
    trainer.fit(TinyMoEModule(TinyMoEConfig(**MODEL), batch_size=MICRO_BATCH,
                                    num_samples=MICRO_BATCH * world * (STEADY + 1)))
    engine = trainer.strategy.deepspeed_engine
    leaves = [n for n, m in engine.module.named_modules() if getattr(m, "_z3_leaf", False)]
    record = {"stage": stage, "ep_size": ep_size, "rank": trainer.global_rank, "world": world,
              "leaf_modules": leaves, **probe.record}
    engine.destroy()
    del trainer, engine
    _trim()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cases", default="3:1,3:2", help="comma-separated stage:ep_size pairs")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # become the launcher, with the allocator settings in every rank
        env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
               __file__, *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd, env=env))
    import torch

    torch.set_num_threads(1)
    records = [run_case(*(int(x) for x in pair.split(":")), args.world) for pair in args.cases.split(",")]
    rank = int(os.environ["RANK"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": args.world, "runs": records}))
    from _teardown import end_job  # tests/jobs: the script's own directory

    end_job()


if __name__ == "__main__":
    main()


def predict(stage: int, ep_size: int, world: int):
    """The planner's peak for one case (torch only to build the model on the meta device)."""
    import torch

    from lightning_zeromoe.config.deepspeed import ZeroOptions, zero_section
    from lightning_zeromoe.planner import estimate_activations
    from lightning_zeromoe.planner.counts import gather_units
    from lightning_zeromoe.planner.setups import Setup
    from lightning_zeromoe.planner.working_set import ZeroBuffers, estimate_peak
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    with torch.device("meta"):
        model = TinyMoELM(TinyMoEConfig(**MODEL))
    # The strategy registers the MoE blocks as ZeRO-3 leaf modules when AutoEP does not convert them.
    leaf = (lambda name, module: hasattr(module, "experts")) if (stage == 3 and ep_size == 1) else (lambda n, m: False)
    act = estimate_activations(micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, hidden_size=MODEL["hidden_size"],
                               num_layers=MODEL["num_layers"], num_heads=MODEL["num_heads"],
                               ffn_hidden_size=MODEL["ffn_hidden_size"], top_k=MODEL["top_k"],
                               vocab_size=MODEL["vocab_size"], precision="fp32", num_experts=MODEL["num_experts"],
                               ep_size=ep_size, expert_loop="slices")  # the reference block loops over fused slices
    return estimate_peak(gather_units(model, leaf), Setup(0, stage), world=world, ep_size=ep_size, precision="fp32",
                         buffers=ZeroBuffers.from_config(zero_section(ZeroOptions(stage=stage, ep_size=ep_size))),
                         activation_per_layer=act.per_layer, activation_logits=act.logits,
                         num_layers=MODEL["num_layers"], backend="gloo")
