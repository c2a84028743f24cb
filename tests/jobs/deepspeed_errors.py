"""Trigger real DeepSpeed errors on CPU (1-process gloo) and print each traceback as a JSON line.

Used by tests/test_explain.py: the knowledge base must recognise the messages the installed
DeepSpeed really raises, and the OOM patch must lower real defaults. Cases:

* ``config_twice``: deepspeed.initialize(args with deepspeed_config, config=...);
* ``no_optimizer``: a ZeRO-3 checkpoint loaded by an engine built without an optimizer, then
  with load_module_only=True, then the consolidation route the entry recommends;
* ``zero_to_fp32_leftover``: zero_to_fp32 on a tag directory with another rank's leftover file;
* ``nccl_missing``: init_process_group("nccl") on a torch without NCCL (CPU builds only);
* ``divisibility``: deepspeed.utils.groups._ensure_divisibility(10, 3);
* ``auto_clipping``: a step of an engine whose config says gradient_clipping "auto" (the Hugging
  Face convention, which DeepSpeed keeps as a string);
* ``offload_estimates``: DeepSpeed's host-RAM estimator for offloaded ZeRO-3 states;
* ``zero_defaults``: DeepSpeedZeroConfig defaults of the keys the cuda-oom patch sets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import torch  # noqa: E402
import deepspeed  # noqa: E402


def emit(case: str, **data) -> None:
    print(json.dumps({"case": case, **data}), flush=True)


def caught(case: str, fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the traceback is the product
        emit(case, traceback=traceback.format_exc())
    else:
        emit(case, traceback=None)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}


def main() -> None:
    if not torch.distributed.is_nccl_available():  # a CPU build of torch: the real refusal
        caught("nccl_missing", lambda: torch.distributed.init_process_group(
            "nccl", init_method="tcp://127.0.0.1:1", rank=0, world_size=1))
    deepspeed.init_distributed(dist_backend="gloo")
    tmp = tempfile.mkdtemp(prefix="ds-errors-")
    config_file = os.path.join(tmp, "ds.json")
    with open(config_file, "w") as f:
        json.dump({"train_batch_size": 1}, f)
    args = argparse.Namespace(deepspeed_config=config_file, local_rank=0)
    model = net()
    caught("config_twice", lambda: deepspeed.initialize(args=args, model=model,
                                                        config={"train_batch_size": 1}))

    stage3 = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    trained = net()
    engine, *_ = deepspeed.initialize(model=trained, model_parameters=trained.parameters(),
                                      config={**stage3, "optimizer": ADAM})
    engine.save_checkpoint(tmp, tag="t")
    bare = net()
    inference, *_ = deepspeed.initialize(model=bare, config=stage3)
    caught("no_optimizer", lambda: inference.load_checkpoint(tmp, tag="t"))
    caught("no_optimizer_module_only", lambda: inference.load_checkpoint(
        tmp, tag="t", load_optimizer_states=False, load_module_only=True))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="t")
    fresh = net()
    missing = fresh.load_state_dict(state, strict=True)
    emit("consolidate", loaded=not missing.missing_keys and not missing.unexpected_keys,
         keys=sorted(state))

    # A leftover optimizer-state file of another rank in the tag directory (an older, larger run).
    import glob
    import shutil

    optim = glob.glob(os.path.join(tmp, "t", "*_optim_states.pt"))[0]
    shutil.copy(optim, optim.replace("zero_pp_rank_0_", "zero_pp_rank_1_"))
    caught("zero_to_fp32_leftover", lambda: get_fp32_state_dict_from_zero_checkpoint(tmp, tag="t"))

    def auto_clipping() -> None:
        clipped = net()
        engine, *_ = deepspeed.initialize(model=clipped, model_parameters=clipped.parameters(),
                                          config={"train_batch_size": 1, "gradient_clipping": "auto",
                                                  "optimizer": ADAM})
        engine.backward(engine(torch.ones(1, 8)).sum())
        engine.step()

    caught("auto_clipping", auto_clipping)

    from deepspeed.utils.groups import _ensure_divisibility

    caught("divisibility", lambda: _ensure_divisibility(10, 3))

    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    estimates = {}
    for params, nodes, offload_params in ((10**9, 1, True), (10**9, 1, False), (7 * 10**9, 2, True),
                                          (3 * 10**8, 4, False)):
        estimates[f"{params}-{nodes}-{offload_params}"] = estimate_zero3_model_states_mem_needs(
            params, 1, num_gpus_per_node=8, num_nodes=nodes, cpu_offload=True,
            cpu_offload_params=offload_params)[0]
    emit("offload_estimates", cpu_bytes=estimates)

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    defaults = DeepSpeedZeroConfig()
    emit("zero_defaults", stage3_prefetch_bucket_size=defaults.prefetch_bucket_size,
         stage3_max_live_parameters=defaults.max_live_parameters,
         stage3_max_reuse_distance=defaults.max_reuse_distance)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
