"""Knowledge-base claims that need an initialised process group, in one CPU process (gloo, world
size 1): start-up is the expensive part, so every such check runs in this one launch.

* ``save16``: does save_16bit_model refuse under AutoEP + ZeRO-3 whatever
  stage3_gather_16bit_weights_on_model_save says? One real engine per flag value (autoep_size 1,
  a tiny Hugging Face Mixtral): {"true": "<exception type>: <message>", "false": ...}.
* ``batch``: what DeepSpeedConfig raises for train_batch_size 16, micro 4 on 8 data-parallel
  ranks (the size comes through DeepSpeed's mpu interface, as Megatron passes it; DeepSpeedConfig
  reads it only once the process group exists).

* ``device_move``: the message ZeroDeviceMoveError carries when a module calls ``.half()`` on its
  ZeRO-3 parameters inside forward (a real ZeRO-3 engine with ZeroMoEStrategy's DeviceMoveGuard).

* ``raised``: what deepspeed.initialize raises for native MoE under ZeRO-3, for native MoE with a
  plain client optimizer under ZeRO-2, for AutoEP on a Mixtral held as ``self.model`` (no layer
  found with the preset; top_k unknown with a pattern rooted at the wrapper), and what a ZeRO-3
  weight used outside the engine's forward raises.

Prints one JSON line.

    python tests/jobs/claims_job.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
if "MASTER_PORT" not in os.environ:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402


def attempt(gather: bool, out_dir: str) -> str:
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                           num_experts_per_tok=1, max_position_embeddings=32)
    model = MixtralForCausalLM(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": gather},
                 "expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Raw DeepSpeed on a Hugging Face model: on transformers >= 5.23 AutoEP needs the registry shim
    # the strategy applies (knowledge-base entry autoep-transformers-5.23).
    from lightning_zeromoe._private.deepspeed import autoep_output_capture_shim

    with autoep_output_capture_shim():
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    assert engine._has_autoep_layers(), "AutoEP did not convert the Mixtral block"
    try:
        saved = engine.save_16bit_model(out_dir, f"gather_{gather}.bin")
    except Exception as err:  # noqa: BLE001 - the point is which exception
        return f"{type(err).__name__}: {err}"
    return f"returned {saved!r}"


class DataParallel:
    """DeepSpeed's mpu interface: only the data-parallel size is read by DeepSpeedConfig."""

    def get_data_parallel_world_size(self) -> int:
        return 8


def batch_error(config: dict) -> str:
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(config, mpu=DataParallel())
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "accepted"


def device_move() -> str:
    from torch import nn

    from lightning_zeromoe.engine.pitfalls import DeviceMoveGuard, ZeroDeviceMoveError

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.lin.half()
            return self.lin(x)

    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=config)
    guard = DeviceMoveGuard(net, torch.device("cpu")).install()
    try:
        engine(torch.ones(1, 4))
    except ZeroDeviceMoveError as err:
        return json.dumps({"message": str(err), "entry_id": err.entry_id})
    finally:
        guard.remove()
    return "no error"


def _error(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the claim is about which exception
        return f"{type(err).__name__}: {err}"
    return "no error"


def raised() -> dict[str, str]:
    from torch import nn
    from deepspeed.moe.layer import MoE

    class NativeMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)

        def forward(self, x):
            return self.moe(x)[0]

    adam = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}

    def native_zero3():
        net = NativeMoE()
        deepspeed.initialize(model=net, model_parameters=net.parameters(),
                             config={"train_batch_size": 1, "zero_optimization": {"stage": 3}, "optimizer": adam})

    def native_plain_groups():
        net = NativeMoE()
        deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                             config={"train_batch_size": 1, "zero_optimization": {"stage": 2}})

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = MixtralForCausalLM(MixtralConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1))

        def forward(self, ids):
            return self.model(ids).logits

    def autoep(extra: dict):
        ep = {"enabled": True, "autoep_size": 1, "preset_model": "mixtral", **extra}
        deepspeed.initialize(model=Wrapper(), config={"train_batch_size": 1, "zero_optimization": {"stage": 3},
                                                      "optimizer": adam, "expert_parallel": ep})

    def outside_forward():
        net = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))
        engine, *_ = deepspeed.initialize(model=net, config={"train_batch_size": 1, "optimizer": adam,
                                                             "zero_optimization": {"stage": 3}})
        torch.nn.functional.embedding(torch.tensor([1, 2]), engine.module[0].weight)

    return {"native_zero3": _error(native_zero3), "native_plain_groups": _error(native_plain_groups),
            "autoep_preset_wrapped": _error(lambda: autoep({})),
            "autoep_pattern_wrapped": _error(lambda: autoep({"moe_layer_pattern": r"model\.model\.layers\.\d+\.mlp"})),
            "outside_forward": _error(outside_forward)}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    print(json.dumps({
        "save16": {str(g).lower(): attempt(g, out_dir) for g in (True, False)},
        "batch": {"16/4/8": batch_error({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}),
                  "16/2/1/8": batch_error({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                           "gradient_accumulation_steps": 1})},
        "device_move": device_move(),
        "raised": raised(),
    }))


if __name__ == "__main__":
    main()
