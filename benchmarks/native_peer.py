"""Side by side with transformers' own expert parallelism (FSDP2 + EP) against ``ZeroMoEStrategy``.

transformers 5.25 shards a model at load time:
``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=W, ep_size=E))`` puts the dense
weights under FSDP2 and splits the experts over EP groups with all-to-all token dispatch
(``transformers/distributed/``). That is the first thing a Hugging Face user tries, so it is the peer.

Models (built from configs, ``save_pretrained`` into a temporary directory, seed 0; no downloads):
a Mixtral-style and a Qwen3-MoE-style causal LM, both hidden ``--hidden`` (256), 4 layers, 8 experts
top-2, expert intermediate size ``--intermediate`` (1024), vocab 1024, 4 heads (2 KV heads), untied
head, fp32: about 26 M parameters, 400 MB of fp32 model states (parameter, gradient and AdamW's two
moments, 16 bytes a parameter) before sharding. Data: the same synthetic token sequences on every side
(``torch.randint``, seed 0), ``--global-batch`` (8) sequences of ``--seq`` (64) tokens per optimizer step,
split over the ranks by ``DistributedSampler(shuffle=False)``; torch's AdamW (lr 1e-3, no weight decay),
no clipping, no accumulation, ``--warmup`` (2) + ``--steps`` (8) steps.

Sides, each its own ``torchrun --nproc-per-node W`` launch on localhost (gloo, CPU, one thread a rank),
on every ``--ranks`` W, ``ep_size = W`` on both (every expert whole on one rank; ``--ep E`` sets another):

* ``native``: ``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=W, ep_size=W))``
  and a plain loop (forward, backward, ``optimizer.step()``, ``zero_grad``).
* ``zeromoe``: a Lightning ``Trainer`` with ``ZeroMoEStrategy(ep_size=W, comm_stats=True)`` (ZeRO-3,
  the default), ``from_pretrained(path)`` in ``configure_model``; ``use_distributed_sampler=False`` and
  the same sampler (Lightning's own would shuffle).

Tried once per run, on 2 ranks and the Mixtral model (a single launch each, not repeated):

* ``native_hf_trainer``: the natively distributed model handed to ``transformers.Trainer``.
* ``native_lightning_mp``: Lightning's ``ModelParallelStrategy`` holding it (``from_pretrained(...,
  distributed_config=...)`` inside ``configure_model``).

* ``native_dcp_save`` / ``native_dcp_load``: transformers' distributed checkpoint on another shape:
  two steps on the fewest ``--ranks``, ``save_pretrained(DIR, distributed_checkpoint=True)``, then
  ``from_pretrained(DIR)`` on the most ranks with their ``ep_size``; the loss of one fixed batch before
  and after (the last model of ``--models``).

What happened with each is printed (the real error if it failed) under "Tries".

**Parity first.** Before the timed launches, each side trains each model once on each ``--ranks`` with SGD
(lr 0.5) in place of AdamW, and its per-step loss (the mean of its ranks' micro-batch losses, which is the
global batch's loss since every rank gets the same number of tokens) must equal a plain single-process SGD
run's on the same global batches within ``--tolerance`` (1e-5; fp32 rounding moves a loss of about 7 by an
ulp, 4.8e-7, or two). A side over it is marked **NO** and the run exits 1 after printing every table. SGD
is the gate because its updates are proportional to the gradients: rounding stays rounding, and a gradient
of the wrong scale, which AdamW's normalised update hides, shows. The driver also runs, single-process,
deliberate changes of the math (the learning rate times 1.01, the router frozen) and prints their distance
to the plain run, so a reader sees what the tolerance would catch.

The timed AdamW launches are compared with the plain AdamW run too, and their drift is printed beside the
plain run's own drift when only the order of each batch's rows changes (``--reorders`` runs, seeds 0, 1,
...): the same loss summed in another order. Under AdamW such a run can drift past 1e-4 in 10 steps on the
Qwen3-MoE model: each update is divided by the root of its second moment, so last-bit differences in a
near-zero gradient become full-size steps, and a top-k router then picks another expert for a token whose
k-th and next router probabilities were within rounding (printed for each reordered run: where its routing
first differs from the plain run's). That drift is information, not a gate.

**Tables** (medians over ``--repeats``; each repeat launches every side once, the first side swapping
each repeat):

* tokens/s: ``W x micro-batch x seq x timed steps`` over rank 0's wall time from the end of the last
  warm-up step to the end of the last step; median and range; ``zeromoe / native`` paired by repeat.
* time to first step: from just before the driver starts ``torchrun`` to the end of the first optimizer
  step on the slowest rank (interpreter start, imports, process group, loading, sharding, the first
  step); beside it the seconds of imports and of setup (imports done to the model ready to step).
* memory per rank, MB (10^6 bytes), of the rank with the highest peak RSS, median over repeats:
  ``baseline``: RSS after the side's imports, before the model (``native``: torch + transformers,
  the ledger's import of Lightning, taken after it, shown as "ledger import"; ``zeromoe``: Lightning,
  ``lightning_zeromoe`` and DeepSpeed, which the strategy would otherwise import at setup); ``model states``:
  the bytes of the distinct tensor storages that hold this rank's parameters (its DTensor shards, or its
  ZeRO-3 partitions and whole local experts), gradients and optimizer state, counted after the last
  optimizer step once the loop has released what it releases between steps: ``native``'s
  ``zero_grad(set_to_none=True)`` frees the gradients; DeepSpeed keeps a flat fp32 master copy of the
  partitions and a flat gradient buffer allocated throughout (``DEEPSPEED_STATES``), counted here;
  ``other tensors``: every other live tensor
  storage Python can reach then (``gc``): communication buckets, caches (C++-held buffers such as
  autograd's saved activations are not reachable and are not in it); ``rest of peak``: peak RSS
  (``ru_maxrss``) minus the three before: the step's transient working set (activations, gathered
  parameters, dispatch buffers) plus allocator slack; ``model-related peak``: peak minus baseline;
  ``peak``: ``ru_maxrss``. RSS samples at phase boundaries (after imports, after setup, after step 1,
  at the end) are in the ``--json`` records.
* bytes per optimizer step by collective and group (rank 0, median over the timed steps), counted by
  :class:`lightning_zeromoe.CommLedger` at the ``torch.distributed`` boundary (full buffers, the
  nccl-tests convention of ``observe/comm_ledger.py``). transformers' token dispatch calls
  ``all_to_all_single`` and ``all_to_all_single_autograd`` through names
  ``transformers/distributed/expert_parallel.py`` imported, which the ledger cannot reach: their forward
  calls are counted by wrapping those two names (as ``tests/jobs/native_ep_layout.py`` does), and the
  backward all-to-all of the tokens, which runs inside autograd out of Python's sight, is taken as equal
  to the forward's token bytes (the gradient of each exchanged row goes back the same way); that row is
  marked "inferred".
* capabilities: what each side can do, each claim about transformers with the installed file it was
  read in, each about this project with its doc or test.

CPU ranks over gloo, one thread each: absolute speeds say nothing about GPUs (where transformers
brings grouped-GEMM expert kernels and we have not measured); byte counts are exact. Run from the
repository root::

    .venv/bin/python benchmarks/native_peer.py --repeats 3 --ranks 2 4 --json /tmp/native_peer.json

(per repeat 2 models x 2 rank counts x 2 sides = 8 launches, plus 4 tries and the two single-process
references once: measured 9.8 minutes for ``--repeats 2`` and 18 minutes for ``--repeats 3`` on the 2-core
machine shared with other jobs, load average 3-8; ``--table FILE`` reprints an earlier ``--json``.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIDES = ("native", "zeromoe")
TRIES = ("native_hf_trainer", "native_lightning_mp")
MODELS = ("mixtral", "qwen3_moe")
LABELS = {"native": "transformers FSDP2 + EP, plain loop", "zeromoe": "Lightning + ZeroMoEStrategy (ZeRO-3 + AutoEP)",
          "native_hf_trainer": "transformers FSDP2 + EP in the HF Trainer",
          "native_lightning_mp": "transformers FSDP2 + EP in Lightning's ModelParallelStrategy"}
LR = 1e-3  # AdamW's, in the timed launches
SGD_LR = 0.5  # SGD's, in the parity launches
TOLERANCE = 1e-5  # the SGD parity gate, max abs loss diff to the plain run
MB = 1e6


# ------------------------------------------------------------------ shared by driver and workers


def build_model(family: str, hidden: int, intermediate: int) -> Any:
    """A Mixtral-style or Qwen3-MoE-style causal LM from a config (seed 0), fp32."""
    import torch
    import transformers

    common = dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=intermediate, num_local_experts=8, **common)
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen3MoeConfig(moe_intermediate_size=intermediate, intermediate_size=intermediate,
                                         num_experts=8, decoder_sparse_step=1, mlp_only_layers=[],
                                         head_dim=hidden // 4, **common)
    return transformers.Qwen3MoeForCausalLM(config)


def make_optimizer(name: str, params: Any) -> Any:
    """``adamw`` (lr 1e-3, no weight decay: the timed launches) or ``sgd`` (lr 0.5: the parity launches)."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


class Tokens:
    """The synthetic sequences (``input_ids`` = ``labels``) as a map-style dataset."""

    def __init__(self, path: Path) -> None:
        import torch

        self.tokens = torch.load(path)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage(t: Any) -> tuple[int, int] | None:
    try:
        t = _local(t)
        if t.device.type == "meta":
            return None
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.nbytes() else None
    except Exception:  # tensor subclasses without a storage of their own
        return None


#: Attributes of DeepSpeed's ZeRO optimizers that hold model states (master weights, flat gradients): they are
#: out of the inner torch optimizer's ``param_groups`` between steps, so they are named here.
DEEPSPEED_STATES = ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "grad_partitions_flat_buffer",
                    "single_partition_of_fp32_groups", "bit16_groups_flat", "averaged_gradients")


def _tensors_in(value: Any) -> list[Any]:
    import torch

    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _owners(objects: list[Any]) -> dict[int, str]:
    """Storage pointer -> ``Class.attribute`` for the tensors the given objects hold directly, or one object
    further (``Class.attribute.sub``: DeepSpeed's IPG buckets): names the big buffers among the "other
    tensors"."""
    import torch

    names: dict[int, str] = {}

    def note(value: Any, name: str) -> None:
        for v in _tensors_in(value):
            s = _storage(v)
            if s:
                names.setdefault(s[0], name)

    for obj in objects:
        for attr, value in getattr(obj, "__dict__", {}).items():
            note(value, f"{type(obj).__name__}.{attr}")
            inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else [value]
            for v in inner:
                if not isinstance(v, (torch.Tensor, torch.nn.Module)) and type(v).__module__.startswith("deepspeed"):
                    for sub, sv in getattr(v, "__dict__", {}).items():
                        note(sv, f"{type(obj).__name__}.{attr}.{sub}")
    return names


def state_bytes(modules: list[Any], optimizers: list[Any],
                holders: list[Any] = ()) -> tuple[int, int, dict[str, float]]:
    """(bytes of the storages holding parameters, gradients and optimizer state; bytes of every other
    live tensor storage ``gc`` reaches; those other bytes in MB by the ``Class.attribute`` of ``holders``,
    the optimizers or ``modules`` that hold them, "unnamed" for the rest). DeepSpeed's partitions
    (``ds_tensor``) and its inner torch optimizer's flat fp32 copies count as model states."""
    import torch

    held: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            if s:
                held[s[0]] = s[1]

    for module in modules:
        for p in module.parameters():
            add(p)
            add(p.grad)
            add(getattr(p, "ds_tensor", None))
    seen: set[int] = set()
    todo = list(optimizers)
    while todo:
        opt = todo.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        todo += [getattr(opt, "optimizer", None), getattr(opt, "_optimizer", None)]
        for attr in DEEPSPEED_STATES:
            for t in _tensors_in(getattr(opt, attr, None)):
                add(t)
        if isinstance(opt, torch.optim.Optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    add(p)
                    add(p.grad)
            for st in opt.state.values():
                for v in st.values():
                    add(v)
    other: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            s = _storage(obj)
            if s and s[0] not in held:
                other[s[0]] = s[1]
    names = _owners([*holders, *modules, *optimizers] + [getattr(o, "optimizer", None) for o in optimizers])
    by_owner: dict[str, float] = {}
    for ptr, n in other.items():
        owner = names.get(ptr, "unnamed")
        by_owner[owner] = by_owner.get(owner, 0.0) + n / MB
    return sum(held.values()), sum(other.values()), by_owner


@dataclass
class Record:
    """One rank of one launch."""

    side: str
    model: str
    rank: int
    world: int
    losses: list[float] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)  # time.time() at the end of each optimizer step
    rss: dict[str, float] = field(default_factory=dict)  # MB at phase boundaries
    seconds: dict[str, float] = field(default_factory=dict)  # epoch times of the phases
    peak_rss_mb: float = 0.0
    states_mb: float = 0.0
    other_tensors_mb: float = 0.0
    other_by_owner: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    calls_per_step: dict[str, float] = field(default_factory=dict)
    group_sizes: dict[str, int] = field(default_factory=dict)
    note: str = ""


class Dispatch:
    """Counts the forward calls of the two all-to-alls transformers' token dispatch makes through names
    ``transformers.distributed.expert_parallel`` imported (out of the ledger's reach)."""

    def __init__(self) -> None:
        from transformers.distributed import expert_parallel

        self.tokens: list[int] = []
        self.counts: list[int] = []
        expert_parallel.all_to_all_single_autograd = self._wrap(expert_parallel.all_to_all_single_autograd,
                                                                self.tokens, 0)
        expert_parallel.all_to_all_single = self._wrap(expert_parallel.all_to_all_single, self.counts, 1)

    @staticmethod
    def _wrap(original: Any, calls: list[int], at: int) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            calls.append(a[at].numel() * a[at].element_size())
            return original(*a, **kw)
        return counted

    def take(self) -> tuple[int, int, int, int]:
        out = (sum(self.tokens), len(self.tokens), sum(self.counts), len(self.counts))
        self.tokens.clear()
        self.counts.clear()
        return out


# ------------------------------------------------------------------ workers (one torchrun launch)


def _sampler(data: Any, world: int, rank: int) -> Any:
    from torch.utils.data import DistributedSampler

    return DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False, drop_last=True)


def _native_config(world: int, ep: int) -> Any:
    from transformers.distributed import DistributedConfig

    return DistributedConfig(fsdp_size=world, ep_size=ep or world)


def _run_native(args: argparse.Namespace, rec: Record) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    rec.rss["imports_own"] = rss_mb()
    from lightning_zeromoe import CommLedger

    rec.rss["imports"] = rss_mb()
    rec.seconds["imports"] = time.time()
    dispatch = Dispatch()
    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=_native_config(rec.world, args.ep),
                                                 dtype=torch.float32)
    model.train()
    opt = make_optimizer(args.optimizer, model.parameters())
    data = Tokens(args.data)
    loader = DataLoader(data, batch_size=args.micro, sampler=_sampler(data, rec.world, rec.rank), drop_last=True)
    rec.rss["setup"] = rss_mb()
    rec.seconds["setup"] = time.time()
    ledger = CommLedger()
    dispatched: list[tuple[int, int, int, int]] = []
    dispatch.take()
    last = args.warmup + args.steps
    with ledger.counting():
        ledger.begin(0)
        for step, batch in enumerate(loader, start=1):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
            loss.backward()
            opt.step()
            rec.marks.append(time.time())
            rec.losses.append(float(loss.detach()))
            ledger.close_step(step)
            dispatched.append(dispatch.take())
            if step == 1:
                rec.rss["step1"] = rss_mb()
            opt.zero_grad(set_to_none=True)
            if step == last:
                states, other, rec.other_by_owner = state_bytes([model], [opt])
                rec.states_mb, rec.other_tensors_mb = states / MB, other / MB
                break
    _ledger_into(rec, ledger, args.warmup)
    timed = dispatched[args.warmup:]
    tokens = statistics.median(d[0] for d in timed)
    key = "all_to_all/ep dispatch"
    rec.bytes_per_step[key + " (forward)"] = tokens + statistics.median(d[2] for d in timed)
    rec.calls_per_step[key + " (forward)"] = statistics.median(d[1] + d[3] for d in timed)
    rec.bytes_per_step[key + " (backward, inferred)"] = tokens
    rec.calls_per_step[key + " (backward, inferred)"] = statistics.median(d[1] for d in timed)
    for k in (key + " (forward)", key + " (backward, inferred)"):
        rec.group_sizes[k] = args.ep or rec.world  # the EP group


def _ledger_into(rec: Record, ledger: Any, warmup: int) -> None:
    steps = [s for s in ledger.steps if s.step > warmup]
    keys = sorted({k for s in steps for k in s.bytes})
    for c, g in keys:
        rec.bytes_per_step[f"{c}/{g}"] = statistics.median(s.bytes.get((c, g), 0) for s in steps)
        rec.calls_per_step[f"{c}/{g}"] = statistics.median(s.calls.get((c, g), 0) for s in steps)
        rec.group_sizes[f"{c}/{g}"] = max(s.group_sizes.get((c, g), 0) for s in steps)


def _lightning_module(args: argparse.Namespace, rec: Record, native: bool) -> Any:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM
    from typing_extensions import override

    last = args.warmup + args.steps

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        @override
        def configure_model(self) -> None:
            if self.model is None:
                extra = {"distributed_config": _native_config(rec.world, args.ep)} if native else {}
                self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **extra)

        @override
        def on_train_start(self) -> None:
            rec.rss["setup"] = rss_mb()
            rec.seconds["setup"] = time.time()

        @override
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
            rec.losses.append(float(loss.detach()))
            return loss

        @override
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            rec.marks.append(time.time())
            step = self.trainer.global_step
            if step == 1:
                rec.rss["step1"] = rss_mb()
            if step == last:
                strategy = self.trainer.strategy
                states, other, rec.other_by_owner = state_bytes(
                    [self.model, strategy.model], list(strategy.optimizers),
                    [strategy.model] + [getattr(o, "_optimizer", None) for o in strategy.optimizers])
                rec.states_mb, rec.other_tensors_mb = states / MB, other / MB

        @override
        def configure_optimizers(self) -> Any:
            return make_optimizer(args.optimizer, self.parameters())

        @override
        def train_dataloader(self) -> DataLoader:
            data = Tokens(args.data)
            return DataLoader(data, batch_size=args.micro, sampler=_sampler(data, rec.world, rec.rank),
                              drop_last=True)

    return Module()


def _trainer_kwargs(args: argparse.Namespace, world: int) -> dict[str, Any]:
    return dict(accelerator="cpu", devices=world, max_steps=args.warmup + args.steps, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)


def _run_zeromoe(args: argparse.Namespace, rec: Record) -> None:
    import deepspeed  # noqa: F401  (the strategy imports it at setup: counted in the baseline, not the model)
    import lightning as L

    from lightning_zeromoe import ZeroMoEStrategy

    rec.rss["imports"] = rss_mb()
    rec.seconds["imports"] = time.time()
    strategy = ZeroMoEStrategy(ep_size=args.ep or rec.world, comm_stats=True)
    trainer = L.Trainer(strategy=strategy, **_trainer_kwargs(args, rec.world))
    trainer.fit(_lightning_module(args, rec, native=False))
    _ledger_into(rec, strategy.comm_ledger, args.warmup)


def _run_native_lightning_mp(args: argparse.Namespace, rec: Record) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_zeromoe import CommLedger

    rec.rss["imports"] = rss_mb()
    rec.seconds["imports"] = time.time()
    ledger = CommLedger()
    strategy = ModelParallelStrategy(data_parallel_size=rec.world, tensor_parallel_size=1)
    trainer = L.Trainer(strategy=strategy, callbacks=[ledger], **_trainer_kwargs(args, rec.world))
    trainer.fit(_lightning_module(args, rec, native=True))
    _ledger_into(rec, ledger, args.warmup)


def _run_native_hf_trainer(args: argparse.Namespace, rec: Record) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from lightning_zeromoe import CommLedger

    rec.rss["imports"] = rss_mb()
    rec.seconds["imports"] = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=_native_config(rec.world, args.ep),
                                                 dtype=torch.float32)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="native_peer_hf_"), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=1, max_steps=args.warmup + args.steps, learning_rate=LR, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, optim="adamw_torch", seed=0,
        ddp_backend="gloo", use_cpu=True, train_sampling_strategy="sequential", dataloader_drop_last=True,
        logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True)
    ledger = CommLedger()

    class Steps(TrainerCallback):
        def on_train_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            rec.rss["setup"] = rss_mb()
            rec.seconds["setup"] = time.time()
            ledger.begin(state.global_step)

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            rec.marks.append(time.time())
            ledger.close_step(state.global_step)
            if state.global_step == 1:
                rec.rss["step1"] = rss_mb()

    class Recording(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            out = super().compute_loss(model, inputs, *a, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            rec.losses.append(float(loss.detach()))
            return out

    trainer = Recording(model=model, args=training_args, train_dataset=Tokens(args.data), callbacks=[Steps()])
    with ledger.counting():
        trainer.train()
    states, other, rec.other_by_owner = state_bytes([model], [trainer.optimizer])
    rec.states_mb, rec.other_tensors_mb = states / MB, other / MB
    rec.note = (f"Trainer saw world_size={training_args.world_size}, process_index={training_args.process_index}, "
                f"distributed loading={getattr(trainer, 'is_distributed_loading_by_transformers', None)}")
    _ledger_into(rec, ledger, args.warmup)


def _run_native_dcp(args: argparse.Namespace, rec: Record) -> None:
    """``save``: two training steps, then ``save_pretrained(DIR, distributed_checkpoint=True)``; ``load``:
    ``from_pretrained(DIR)`` on this launch's ranks and ``ep_size``. Both record the loss of one fixed batch
    (the first global batch, on every rank) in ``rec.losses``."""
    import torch
    from transformers import AutoModelForCausalLM

    rec.rss["imports"] = rss_mb()
    rec.seconds["imports"] = time.time()
    save = args.worker == "native_dcp_save"
    model = AutoModelForCausalLM.from_pretrained(args.model if save else args.dcp, dtype=torch.float32,
                                                 distributed_config=_native_config(rec.world, args.ep))
    tokens = Tokens(args.data).tokens
    rec.seconds["setup"] = time.time()
    if save:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        for step in range(2):
            batch = tokens[(step * rec.world + rec.rank) * args.micro:(step * rec.world + rec.rank + 1) * args.micro]
            model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.marks.append(time.time())
        model.save_pretrained(args.dcp, distributed_checkpoint=True)
    with torch.no_grad():
        batch = tokens[:args.micro * rec.world]
        rec.losses.append(float(model(input_ids=batch, labels=batch, use_cache=False).loss))


RUNNERS = {"native": _run_native, "zeromoe": _run_zeromoe, "native_hf_trainer": _run_native_hf_trainer,
           "native_lightning_mp": _run_native_lightning_mp, "native_dcp_save": _run_native_dcp,
           "native_dcp_load": _run_native_dcp}


def worker(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rec = Record(side=args.worker, model=args.family, rank=rank, world=world)
    rec.rss["start"] = rss_mb()
    import torch

    torch.set_num_threads(1)
    try:
        RUNNERS[args.worker](args, rec)
    except Exception as exc:  # a try that fails: its real error goes into the record
        rec.note = f"FAILED: {type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc()[-3000:])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(asdict(rec)))
        raise
    rec.rss["end"] = rss_mb()
    rec.peak_rss_mb = peak_mb()
    timed = rec.marks[args.warmup - 1:] if args.warmup else rec.marks
    if len(timed) > 1 and timed[-1] > timed[0]:
        rec.tokens_per_s = world * args.micro * args.seq * (len(timed) - 1) / (timed[-1] - timed[0])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(asdict(rec)))
    return 0


# ------------------------------------------------------------------ driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(side: str, family: str, world: int, base: Path, out: Path, args: argparse.Namespace,
           must_work: bool = True, optimizer: str = "adamw") -> dict[str, Any]:
    """One torchrun launch; its ranks' records, the launch's wall time and its start time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), str(Path(__file__).resolve()), "--worker", side,
           "--family", family, "--model", str(base / family), "--data", str(base / "tokens.pt"), "--out", str(out),
           "--micro", str(args.global_batch // world), "--seq", str(args.seq), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--ep", str(args.ep), "--dcp", str(base / "dcp"), "--optimizer", optimizer]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, log = -9, f"timed out after {args.timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    wall = time.time() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(log if isinstance(log, str) else str(log))
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if code != 0:
        if must_work:
            raise SystemExit(f"{side}/{family}/{world} failed (exit {code}), log {out / 'log.txt'}:\n{log[-4000:]}")
        notes = [r["note"] for r in ranks if r.get("note")]
        error = notes[0] if notes else _last_error(log)
        return {"side": side, "model": family, "world": world, "ok": False, "error": error, "wall_s": wall}
    print(f"  {side:>20} {family:>10} W={world}: {wall:.0f} s", flush=True)
    return {"side": side, "model": family, "world": world, "ok": True, "t0": t0, "wall_s": wall,
            "ranks": sorted(ranks, key=lambda r: r["rank"])}


def _last_error(log: str) -> str:
    lines = [line for line in log.splitlines() if "Error" in line or "error" in line]
    return "\n".join(lines[-6:]) or log[-2000:]


def reference_losses(family: str, base: Path, args: argparse.Namespace, optimizer: str = "adamw",
                     reorder_seed: int | None = None, change: str = "",
                     routes: list[list[Any]] | None = None) -> list[float]:
    """The plain single-process run: the global batches in order, the same model and optimizer.

    ``reorder_seed``: each global batch's rows in a random order (the same loss, summed in another order).
    ``change``: a deliberate change of the math, for the controls: ``lr x1.01`` or ``router frozen``.
    ``routes``: filled with each step's experts per token and layer (sorted top-k indices, in the batch's
    original row order) and the router's probabilities, from the routers (``mlp.gate``, whose output is
    ``(logits, weights, indices)`` in both families)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base / family), dtype=torch.float32)
    model.train()
    step_routes: list[Any] = []
    if routes is not None:
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda mod, inp, out: step_routes.append(
                (out[2].sort(-1).values, out[0].detach().float().softmax(-1))))
    params = [p for n, p in model.named_parameters() if not (change == "router frozen" and ".mlp.gate." in n)]
    opt = make_optimizer(optimizer, params)
    if change == "lr x1.01":
        for group in opt.param_groups:
            group["lr"] *= 1.01
    tokens = torch.load(base / "tokens.pt")
    gen = torch.Generator().manual_seed(reorder_seed) if reorder_seed is not None else None
    losses = []
    for step in range(args.warmup + args.steps):
        batch = tokens[step * args.global_batch:(step + 1) * args.global_batch]
        order = torch.randperm(len(batch), generator=gen) if gen is not None else torch.arange(len(batch))
        batch = batch[order]
        step_routes.clear()
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        if routes is not None:  # back to the original row order: row order[i] of the batch sits at i
            undo = torch.argsort(order)
            routes.append([tuple(t.view(len(batch), args.seq, -1)[undo].flatten(0, 1) for t in r)
                           for r in step_routes])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def first_reroute(routes: list[list[Any]], ref: list[list[Any]]) -> str:
    """Where a run's routing first differs from the reference run's: step, layer, how many tokens, and how
    far apart the reference's k-th and next router probabilities were for the first of them."""
    for step, (mine, theirs) in enumerate(zip(routes, ref), start=1):
        for layer, ((a, _), (b, probs)) in enumerate(zip(mine, theirs)):
            moved = (a != b).any(-1)
            if moved.any():
                k = a.shape[-1]
                top = probs[int(moved.nonzero()[0, 0])].topk(k + 1).values
                n = int(moved.sum())
                return (f"step {step}, layer {layer}: {n} token{'s' * (n > 1)} (the first one's probabilities of "
                        f"its expert {k} and {k + 1} in the plain run {float(top[k - 1] - top[k]):.1e} apart)")
    return "none"


def _drift(losses: list[float], ref: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, ref)) if len(losses) == len(ref) else float("inf")


def parity(run: dict[str, Any], ref: list[float]) -> float:
    """Max abs diff between the mean of the ranks' per-step losses and the single-process losses."""
    ranks = run["ranks"]
    steps = min(len(r["losses"]) for r in ranks)
    if steps != len(ref):
        return float("inf")
    return _drift([statistics.fmean(r["losses"][i] for r in ranks) for i in range(steps)], ref)


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _span(values: list[float], fmt: str = ".0f") -> str:
    return f"{_med(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def parity_tables(res: dict[str, Any], runs: list[dict[str, Any]], tol: float) -> list[str]:
    """The SGD parity launches against the plain run (the gate), and the timed AdamW launches' drift beside
    the plain run's own drift when only the order of each batch's rows changes."""
    out = ["### Parity with a plain single-process run (max abs diff of the per-step loss)", "",
           f"SGD (lr {SGD_LR:g}), one launch each: the gate.", "",
           f"| model | ranks | side | max abs diff | within {tol:g} |", "|---|---:|---|---:|---|"]
    for r in sorted(res.get("parity_runs", []), key=lambda r: (r["model"], r["world"], r["side"])):
        out.append(f"| {r['model']} | {r['world']} | {r['side']} | {r['parity']:.1e} | "
                   f"{'yes' if r['parity'] <= tol else '**NO**'} |")
    out += ["", f"AdamW (lr {LR:g}), the timed launches (every launch), beside the plain run against itself with "
            "each batch's rows reordered (max over the reordered runs) and deliberate changes of the math:", "",
            "| model | ranks | side | launches | max abs diff |", "|---|---:|---|---:|---:|"]
    for r in sorted({((x["model"], x["world"]), x["side"]) for x in runs if "parity" in x},
                    key=lambda x: (x[0][0], x[0][1], x[1])):
        diffs = [x["parity"] for x in runs if (x["model"], x["world"]) == r[0] and x["side"] == r[1]]
        out.append(f"| {r[0][0]} | {r[0][1]} | {r[1]} | {len(diffs)} | {max(diffs):.1e} |")
    for family, reorders in res.get("reorders", {}).items():
        out.append(f"| {family} | 1 | plain, rows reordered | {len(reorders)} | "
                   f"{max(r['drift'] for r in reorders):.1e} |")
    out += ["", "The plain AdamW run with each batch's rows reordered (seed: max abs diff; where its top-k "
            "routing first differs from the plain run's, counted in the batch's original row order):", ""]
    for family, reorders in res.get("reorders", {}).items():
        out.append(f"- {family}: " + "; ".join(f"{r['seed']}: {r['drift']:.1e}, rerouted {r['first_reroute']}"
                                               for r in reorders))
    out += ["", "Changes of the math in the plain run (max abs diff to the unchanged plain run, same optimizer):", ""]
    for family, controls in res.get("controls", {}).items():
        out.append(f"- {family}: " + "; ".join(f"{k} {v:.1e}" for k, v in controls.items()))
    return out


def tables(res: dict[str, Any]) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_compare import on_the_wire

    runs = [r for r in res["runs"] if r["ok"]]
    tol = res["args"]["tolerance"]
    out: list[str] = []
    key = lambda r: (r["model"], r["world"])  # noqa: E731
    combos = sorted({key(r) for r in runs if r["side"] in SIDES}, key=lambda k: (MODELS.index(k[0]), k[1]))

    def of(side: str, combo: tuple[str, int]) -> list[dict[str, Any]]:
        return [r for r in runs if r["side"] == side and key(r) == combo]

    out += parity_tables(res, runs, tol)
    out += ["", "### Throughput and start", "",
            "| model | ranks | side | tokens/s, median (range) | zeromoe / native, paired | time to first step, s | "
            "imports, s | setup, s |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for combo in combos:
        for side in SIDES:
            rs = of(side, combo)
            tps = [r["ranks"][0]["tokens_per_s"] for r in rs]
            ttfs = [max(x["marks"][0] for x in r["ranks"]) - r["t0"] for r in rs]
            imp = [r["ranks"][0]["seconds"]["imports"] - r["t0"] for r in rs]
            setup = [r["ranks"][0]["seconds"]["setup"] - r["ranks"][0]["seconds"]["imports"] for r in rs]
            ratio = ""
            if side == "zeromoe":
                pairs = [z["ranks"][0]["tokens_per_s"] / n["ranks"][0]["tokens_per_s"]
                         for z, n in zip(rs, of("native", combo))]
                ratio = _span(pairs, ".2f") if pairs else ""
            out.append(f"| {combo[0]} | {combo[1]} | {side} | {_span(tps)} | {ratio} | {_span(ttfs, '.1f')} | "
                       f"{_med(imp):.1f} | {_med(setup):.1f} |")
    out += ["", "### Memory per rank, MB (the rank with the highest peak RSS; median over launches)", "",
            "| model | ranks | side | baseline (imports) | model states | other tensors | rest of peak | "
            "model-related peak | peak RSS | zeromoe / native, model-related |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for combo in combos:
        rel: dict[str, float] = {}
        for side in SIDES:
            cols: dict[str, list[float]] = {c: [] for c in ("base", "states", "other", "rest", "rel", "peak")}
            ledger_cost: list[float] = []
            for r in of(side, combo):
                top = max(r["ranks"], key=lambda x: x["peak_rss_mb"])
                base = top["rss"]["imports"]
                cols["base"].append(top["rss"].get("imports_own", base))
                if "imports_own" in top["rss"]:
                    ledger_cost.append(base - top["rss"]["imports_own"])
                cols["states"].append(top["states_mb"])
                cols["other"].append(top["other_tensors_mb"])
                cols["rest"].append(top["peak_rss_mb"] - base - top["states_mb"] - top["other_tensors_mb"])
                cols["rel"].append(top["peak_rss_mb"] - base)
                cols["peak"].append(top["peak_rss_mb"])
            if not cols["peak"]:
                continue
            rel[side] = _med(cols["rel"])
            note = f" (+{_med(ledger_cost):.0f} ledger import)" if ledger_cost else ""
            ratio = f"{rel['zeromoe'] / rel['native']:.2f}" if side == "zeromoe" and "native" in rel else ""
            out.append(f"| {combo[0]} | {combo[1]} | {side} | {_med(cols['base']):.0f}{note} | "
                       f"{_med(cols['states']):.0f} | {_med(cols['other']):.0f} | {_med(cols['rest']):.0f} | "
                       f"{_med(cols['rel']):.0f} | {_med(cols['peak']):.0f} | {ratio} |")
    out += ["", "Other tensors by holder (`Class.attribute` holding the storage; first launch, the rank with the "
            "highest peak), MB:", ""]
    for combo in combos:
        for side in SIDES:
            rs = of(side, combo)
            if rs:
                top = max(rs[0]["ranks"], key=lambda x: x["peak_rss_mb"])
                held = sorted(top.get("other_by_owner", {}).items(), key=lambda kv: -kv[1])
                out.append(f"- {combo[0]}, {combo[1]} ranks, {side}: "
                           + (", ".join(f"{k} {v:.0f}" for k, v in held if v >= 0.5) or "none over 0.5 MB"))
    out += ["", "### Bytes per optimizer step by collective and group (rank 0, full buffers, median)", ""]
    for combo in combos:
        rows = {}
        for side in SIDES:
            for r in of(side, combo):
                rank0 = r["ranks"][0]
                for k, b in rank0["bytes_per_step"].items():
                    rows.setdefault(k, {}).setdefault(side, []).append(
                        (b, rank0["calls_per_step"].get(k, 0), rank0["group_sizes"].get(k, 0)))
        out += [f"{combo[0]}, {combo[1]} ranks:", "", "| collective/group (ranks in group) | native: bytes (calls) | "
                "zeromoe: bytes (calls) |", "|---|---:|---:|"]
        totals = {s: 0.0 for s in SIDES}
        wire = {s: 0.0 for s in SIDES}
        for k in sorted(rows):
            cells = []
            size = max(v[2] for side in rows[k].values() for v in side)
            for side in SIDES:
                vals = rows[k].get(side)
                if not vals:
                    cells.append("")
                    continue
                b = _med([v[0] for v in vals])
                totals[side] += b
                wire[side] += on_the_wire(k.split("/")[0], b, size)
                cells.append(f"{b:,.0f} ({_med([v[1] for v in vals]):g})")
            out.append(f"| {k} ({size}) | " + " | ".join(cells) + " |")
        out.append("| total, full buffers | " + " | ".join(f"{totals[s]:,.0f}" for s in SIDES) + " |")
        out.append("| total on the wire per rank ((n-1)/n of each, 2(n-1)/n for all-reduce, 0 in a 1-rank group) | "
                   + " | ".join(f"{wire[s]:,.0f}" for s in SIDES) + " |")
        out.append("")
    tries = [r for r in res["runs"] if r["side"] in TRIES]
    if tries:
        out += ["### Tries: the natively distributed model inside other trainers (one launch each)", ""]
        for r in tries:
            if r["ok"]:
                rank0 = r["ranks"][0]
                out.append(f"- {LABELS[r['side']]} ({r['model']}, {r['world']} ranks): ran; parity "
                           f"{r['parity']:.1e}; {rank0['tokens_per_s']:.0f} tokens/s; peak RSS "
                           f"{max(x['peak_rss_mb'] for x in r['ranks']):.0f} MB. {rank0.get('note', '')}")
            else:
                out.append(f"- {LABELS[r['side']]} ({r['model']}, {r['world']} ranks): FAILED:\n\n```\n"
                           f"{r['error'].strip()[-1500:]}\n```")
        out.append("")
    dcp = {r["side"]: r for r in res["runs"] if r["side"] in ("native_dcp_save", "native_dcp_load")}
    if len(dcp) == 2 and all(r["ok"] for r in dcp.values()):
        a, b = dcp["native_dcp_save"], dcp["native_dcp_load"]
        la, lb = a["ranks"][0]["losses"][-1], b["ranks"][0]["losses"][-1]
        out += [f"- transformers' distributed checkpoint on another shape ({a['model']}): two steps on {a['world']} "
                f"ranks, `save_pretrained(DIR, distributed_checkpoint=True)`, then `from_pretrained(DIR)` with "
                f"`DistributedConfig(fsdp_size={b['world']}, ep_size={b['world']})` on {b['world']} ranks: the loss of "
                f"one fixed batch {la:.7f} before, {lb:.7f} after (diff {abs(la - lb):.1e}). Weights only; the "
                "optimizer's state has its own calls (`save_optimizer_distributed`), not tried here.", ""]
    elif dcp:
        out += [f"- transformers' distributed checkpoint on another shape: {r['side']} FAILED:\n\n```\n"
                f"{r['error'].strip()[-1500:]}\n```" for r in dcp.values() if not r["ok"]] + [""]
    out += ["### Capabilities", "", CAPABILITIES]
    return "\n".join(out)


@dataclass(frozen=True)
class Source:
    """A capability claim's evidence: ``text`` occurs in ``path`` (under the installed transformers package
    when ``transformers`` is true, else under this repository). ``tests/test_native_peer.py`` checks each."""

    path: str
    text: str
    transformers: bool = True


SOURCES = (
    Source("distributed/fsdp.py", "keep_full_weight"), Source("distributed/fsdp.py", "CPUOffloadPolicy()"),
    Source("distributed/fsdp.py", "param_dtype=torch.bfloat16"),
    Source("distributed/fsdp.py", "TODO(3outeille): make sure new FSDP works with PEFT"),
    Source("distributed/configuration_utils.py", "dp_replicate_size"),
    Source("distributed/configuration_utils.py", "return self.fsdp_size * self.tp_size // self.ep_size"),
    Source("distributed/expert_parallel.py", "all_to_all_single_autograd"),
    Source("distributed/checkpoint.py", "def save_optimizer_distributed"),
    Source("distributed/checkpoint.py", "def _load_model_checkpoint_distributed"),
    Source("modeling_utils.py", "When `False`, weights are gathered to CPU on rank 0"),
    Source("trainer.py", "is_distributed_loading_by_transformers"),
    Source("integrations/moe.py", "sonicmoe"),
    Source("docs/reference/coverage.md", "EP, exact", transformers=False),
    Source("docs/guides/checkpoints.md", "## Resume on another shape", transformers=False),
    Source("docs/guides/checkpoints.md", "## LoRA with frozen experts under expert parallelism", transformers=False),
    Source("docs/guides/planning.md", "offload", transformers=False),
    Source("docs/concepts/conversion-probe.md", "probe", transformers=False),
    Source("tests/test_resume.py", "ep_size", transformers=False),
    Source("tests/test_lora_ep.py", "ep_size", transformers=False),
    Source("tests/test_export_units.py", "export", transformers=False),
    Source("tests/test_hf_coverage.py", "coverage", transformers=False),
)
#: Model directories of the installed transformers whose modeling defines an EP plan (``base_model_ep_plan``).
EP_PLAN_DIRS = 79
#: Our coverage verdicts (docs/reference/coverage.md), as the capability table states them.
COVERAGE = {"EP": 50, "ZeRO-3 fallback": 13, "fails": 1, "refused": 1}


#: Each transformers claim was read in the installed transformers 5.25.0 (site-packages/transformers/...);
#: each claim about this project points at its doc or test.
CAPABILITIES = """\
| | transformers FSDP2 + EP (`DistributedConfig`) | Lightning + `ZeroMoEStrategy` |
|---|---|---|
| sharding choices | FSDP2 only (parameters, gradients and optimizer state sharded, like ZeRO-3); per module, \
`fsdp_plan` "keep_full_weight" keeps the gathered weights from forward to backward; HSDP via \
`dp_replicate_size`; no states-only (ZeRO-1/2-like) option (`distributed/fsdp.py`, \
`distributed/configuration_utils.py`) | ZeRO stage 1, 2 or 3, or `stage="auto"` chosen by the planner \
(docs/guides/planning.md, docs/guides/finetune-hf.md) |
| offload | `fsdp_cpu_offload=True`: FSDP2's `CPUOffloadPolicy` (parameters, gradients, optimizer step on CPU) \
(`distributed/fsdp.py`) | DeepSpeed's optimizer/parameter offload, rows of its own in the planner \
(docs/guides/planning.md) |
| mixed precision | `fsdp_mixed_precision=True`: bf16 compute, fp32 reduce, nothing else \
(`distributed/fsdp.py`) | Lightning precision plugins through DeepSpeed (bf16, fp16) |
| expert parallelism | `ep_size` dividing `fsdp_size*tp_size`; tokens by all-to-all; experts FSDP-sharded over \
`efsdp = fsdp*tp/ep` ranks (`distributed/configuration_utils.py`, `distributed/expert_parallel.py`) | \
DeepSpeed AutoEP; ZeRO over expert data-parallel groups of `world/ep` (docs/concepts/models.md) |
| which families get EP | 79 model directories define a `base_model_ep_plan` in the installed `models/*/`, \
among them 13 types that get no EP on our side (12 ZeRO-3 fallbacks: GPT-OSS, DeepSeek-V4, Nemotron-H, \
Phi-MoE, ...; Inkling2-Loop, which fails), but not DBRX, JetMoE or Doge; whether those plans train \
correctly is not checked here (Mixtral and Qwen3-MoE are) | 64 MoE causal-LM types of transformers' \
registry (+1 variant) tried: 49 (+1 variant) with EP at parity with a plain run, 13 fall back to ZeRO-3 \
without EP, 1 refused, 1 fails (docs/reference/coverage.md, `tests/test_hf_coverage.py`); also non-HF \
blocks (docs/guides/own-moe-blocks.md) |
| save / resume | `save_pretrained(distributed_checkpoint=True)` writes DCP shards that `from_pretrained` \
reloads into the current mesh; `save_optimizer_distributed` / `load_optimizer_distributed` for the \
optimizer (`distributed/checkpoint.py`, `modeling_utils.py`); weights saved on 2 ranks reload on 4 with \
another `ep_size` (the benchmark's Tries); the optimizer's state on another shape not tried | resume on \
another world size and `ep_size` through DeepSpeed's universal checkpoint (docs/guides/checkpoints.md \
"Resume on another shape", `tests/test_resume.py`) |
| export to an HF directory | `save_pretrained(...)` gathers the full state dict to rank 0 \
(`modeling_utils.py`, `distributed_checkpoint` docstring) | `zeromoe-export` (docs/guides/checkpoints.md, \
`tests/test_export_units.py`) |
| LoRA with EP | nothing in `distributed/` handles PEFT adapters for the FSDP2 + EP path (`distributed/fsdp.py`'s \
PEFT section is Accelerate's FSDP plugin, marked `TODO(3outeille): make sure new FSDP works with PEFT`); \
not tried here | PEFT LoRA with frozen EP experts: saves, resumes, exports (docs/guides/checkpoints.md \
"LoRA with frozen experts under expert parallelism", `tests/test_lora_ep.py`) |
| trainers | a plain loop; the HF `Trainer` (it leaves a model sharded at load to itself: `trainer.py`, \
`is_distributed_loading_by_transformers`); Lightning's `ModelParallelStrategy` (see Tries) | \
Lightning `Trainer` |
| checks at setup | `DistributedConfig` validates sizes (`distributed/configuration_utils.py`) | the conversion \
probe runs each converted block against the original (docs/concepts/conversion-probe.md) |
| GPU expert kernels | `experts_implementation`: grouped_mm, deepgemm, sonicmoe (`integrations/moe.py`) | \
DeepSpeed AutoEP's own; not measured on GPUs (docs/limitations.md) |
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024, help="expert intermediate size")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all ranks")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    parser.add_argument("--ep", type=int, default=0, help="ep_size on both sides (default: the number of ranks)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="max abs loss diff to the plain run in the SGD parity launches")
    parser.add_argument("--reorders", type=int, default=8,
                        help="plain AdamW runs with each batch's rows reordered: the rounding envelope")
    parser.add_argument("--no-tries", action="store_true", help="skip the HF Trainer / ModelParallelStrategy tries")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="write every launch's records here")
    parser.add_argument("--table", type=Path, help="only print the tables of an earlier run's --json file")
    parser.add_argument("--worker", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dcp", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.table:
        res = json.loads(args.table.read_text())
        print(header(res))
        print(tables(res))
        return 0
    for w in args.ranks:
        if args.global_batch % w:
            parser.error(f"--global-batch {args.global_batch} does not split over {w} ranks")
    import torch

    torch.set_num_threads(1)
    started = time.time()
    res: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _machine(), "runs": [],
        "reference": {}, "reference_sgd": {}, "reorders": {}, "controls": {}, "parity_runs": []}
    failed = []
    with tempfile.TemporaryDirectory(prefix="native_peer_") as tmp:
        base = Path(tmp)
        gen = torch.Generator().manual_seed(0)
        n = args.global_batch * (args.warmup + args.steps)
        torch.save(torch.randint(0, 1024, (n, args.seq), generator=gen), base / "tokens.pt")
        for family in args.models:
            model = build_model(family, args.hidden, args.intermediate)
            model.save_pretrained(base / family)
            params = sum(p.numel() for p in model.parameters())
            res.setdefault("params", {})[family] = params
            del model
            t = time.time()
            ref_routes: list[list[Any]] = []
            ref = res["reference"][family] = reference_losses(family, base, args, routes=ref_routes)
            sgd = res["reference_sgd"][family] = reference_losses(family, base, args, "sgd")
            res["reorders"][family] = []
            for k in range(args.reorders):
                routes: list[list[Any]] = []
                drift = _drift(reference_losses(family, base, args, reorder_seed=k, routes=routes), ref)
                res["reorders"][family].append({"seed": k, "drift": drift,
                                                "first_reroute": first_reroute(routes, ref_routes)})
            res["controls"][family] = {f"{change}, {opt}": _drift(
                reference_losses(family, base, args, opt, change=change), sgd if opt == "sgd" else ref)
                for opt in ("sgd", "adamw") for change in ("lr x1.01", "router frozen")}
            print(f"{family}: {params / 1e6:.1f} M parameters; single-process references, {args.reorders} reordered "
                  f"runs and 4 controls {time.time() - t:.0f} s", flush=True)

        def record(run: dict[str, Any]) -> None:
            if run["ok"]:
                run["parity"] = parity(run, res["reference"][run["model"]])
            res["runs"].append(run)

        print("parity (SGD, one launch per model, rank count and side)", flush=True)
        for family in args.models:
            for world in args.ranks:
                for side in SIDES:
                    run = launch(side, family, world, base, base / "out" / f"parity{side}{family}{world}", args,
                                 optimizer="sgd")
                    run["parity"] = parity(run, res["reference_sgd"][family])
                    if run["parity"] > args.tolerance:
                        failed.append(f"{side}/{family}/{world}: {run['parity']:.2e}")
                    res["parity_runs"].append({k: run[k] for k in ("side", "model", "world", "parity", "wall_s")})

        if not args.no_tries:
            print("tries (one launch each)", flush=True)
            for side in TRIES:
                run = launch(side, args.models[0], min(args.ranks), base, base / "out" / side, args, must_work=False)
                if not run["ok"]:
                    print(f"  {side}: FAILED\n{run['error'][-800:]}", flush=True)
                record(run)
            small, large = min(args.ranks), max(args.ranks)
            for side, world in (("native_dcp_save", small), ("native_dcp_load", large)):
                run = launch(side, args.models[-1], world, base, base / "out" / side, args, must_work=False)
                if not run["ok"]:
                    print(f"  {side}: FAILED\n{run['error'][-800:]}", flush=True)
                res["runs"].append(run)
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
            for family in args.models:
                for world in args.ranks:
                    for side in order:
                        record(launch(side, family, world, base, base / "out" / f"{side}{family}{world}r{repeat}",
                                      args))
    res["wall_s"] = time.time() - started
    res["load_end"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(header(res))
    print(tables(res))
    if failed:
        print("\nPARITY FAILED (SGD, over --tolerance {:g}): {}".format(args.tolerance, "; ".join(failed)))
        return 1
    return 0


def header(res: dict[str, Any]) -> str:
    """When, where, the command, and the setup the tables were measured with."""
    a = res["args"]
    params = ", ".join(f"{k} {v / 1e6:.1f} M parameters" for k, v in res["params"].items())
    return (f"{res['date']}; {res['machine']}\n{res['command']}\n{a['repeats']} repeats; models {params}; "
            f"global batch {a['global_batch']} x {a['seq']} tokens; {a['warmup']} warm-up + {a['steps']} timed "
            f"steps; fp32; ep_size = {a.get('ep') or 'ranks'}; whole run {res['wall_s'] / 60:.1f} min; load average at "
            f"the end {res.get('load_end', '?')}\n")


def _machine() -> str:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return (f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average at start "
            f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; python {platform.python_version()}")


if __name__ == "__main__":
    raise SystemExit(main())
