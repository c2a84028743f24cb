"""One training step of the tiny MoE under an address-space limit the kernel enforces.

Run by :func:`troubleshooter.repro.oom` as ``python -m troubleshooter.repro._oom_child JSON``;
prints one JSON line per rung. Why a child process: ``RLIMIT_AS`` applies to the whole process,
so it must never touch the caller (a notebook kernel, pytest). Why one fork per rung: importing
torch costs seconds (far more on a busy machine), so the child imports it once and forks a fresh
process for each rung; a fork starts with its own peak counters (the kernel resets ``VmPeak`` and
``VmHWM`` to the current size at fork), so every rung is measured from the same baseline. The
limit is set in the fork *after* the model is built: ``budget_mb`` is what the training step
itself may add to the address space, so the numbers do not depend on how large the torch
libraries are on this machine.

Peak memory is read from ``/proc/self/status``: ``VmPeak`` (the address-space high-water mark,
which is what the limit is compared against) and ``VmHWM`` (the resident high-water mark, what
``ru_maxrss`` reports), both as the growth over the moment the limit was set.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_rung(spec: dict) -> dict:
    """Build the model, set the limit, run one optimizer step; say whether it fitted and the peaks."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from lightning_zeromoe.reference.models import (SyntheticLMData, TinyMoEConfig, TinyMoELM, capture_router_logits,
                                          load_balancing_loss)

    torch.manual_seed(spec["seed"])
    config = TinyMoEConfig(**spec["model"])
    model = TinyMoELM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro, accum = spec["micro_batch"], spec["accumulation"]
    data = SyntheticLMData(micro * accum, spec["seq_len"] + 1, config.vocab_size, seed=spec["seed"])

    def forward(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = model.embed(ids) + model.pos(positions)
        with capture_router_logits(model) as router_logits:
            for layer in model.layers:
                # Activation checkpointing: keep only each layer's input, recompute the rest in backward.
                x = checkpoint(layer, x, use_reentrant=False) if spec["checkpointing"] else layer(x)
            n = len(model.layers)
            aux = load_balancing_loss(router_logits[:n], config.top_k, ids.shape[0]).mean()
        logits = model.lm_head(model.norm(x))
        return logits, aux

    cuda = spec.get("device") == "cuda"
    if cuda:  # untested on the CPU-only development machine (see troubleshooter.repro.memory)
        model.cuda()
        data.tokens = data.tokens.cuda()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
        if spec["budget_mb"] is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, (base_cuda + spec["budget_mb"] * 2**20) / total))
    base_vm, base_rss = _status_kib("VmSize"), _status_kib("VmRSS")
    if spec["budget_mb"] is not None and not cuda:
        limit = base_vm * 1024 + spec["budget_mb"] * 2**20
        # Soft limit only: the kernel enforces it; this fork exits after the rung anyway.
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    out = {"ok": False, "oom": False, "error": None, "loss": None}
    start = time.perf_counter()
    try:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(accum):
            ids = data.tokens[i * micro:(i + 1) * micro]
            logits, aux = forward(ids[:, :-1])
            task = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss = (task + config.aux_loss_weight * aux) / accum
            loss.backward()
            total += float(loss.detach())
            del logits, aux, task, loss
        optimizer.step()
        out.update(ok=True, loss=total)
    except (RuntimeError, MemoryError) as err:  # the allocator's failure, raised as a Python error
        text = str(err).strip()
        message = text.splitlines()[-1] if text else type(err).__name__
        out.update(oom=any(s in text for s in ("can't allocate memory", "bad_alloc", "out of memory"))
                   or isinstance(err, MemoryError), error=f"{type(err).__name__}: {message}")
    out.update(seconds=time.perf_counter() - start,
               peak_vm_mb=(_status_kib("VmPeak") - base_vm) / 1024,
               peak_rss_mb=(_status_kib("VmHWM") - base_rss) / 1024)
    if cuda:
        out["peak_vm_mb"] = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    return out


def main(spec: dict) -> None:
    """Import once, then fork one process per rung and print each rung's JSON line in order."""
    import os

    import torch

    import lightning_zeromoe.reference.models  # noqa: F401 - imported before forking, once

    torch.set_num_threads(1)  # no OpenMP pool exists before the forks: forking is safe
    for rung in spec["rungs"]:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rung's own process
            os.close(read_end)
            try:
                result = run_rung({**spec, **rung})
            except BaseException as err:  # noqa: BLE001 - report anything, never hang the parent
                result = {"ok": False, "oom": False, "error": f"{type(err).__name__}: {err}"}
            with os.fdopen(write_end, "w") as handle:
                handle.write(json.dumps(result))
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as handle:
            text = handle.read()
        _, status = os.waitpid(pid, 0)
        result = json.loads(text) if text else {
            "ok": False, "oom": False, "error": f"rung process died (wait status {status})"}
        print(json.dumps({**rung, **result}), flush=True)
        if result.get("ok") and spec.get("stop_when_fits", True) and rung.get("budget_mb") is not None:
            break


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
