"""Private Lightning hooks and torch c10d APIs we rely on still exist (an upgrade fails here, by name)."""

from __future__ import annotations


import torch

from lightning.pytorch.strategies import DeepSpeedStrategy
from typing_extensions import override  # noqa: F401  (the decorator the strategy uses)

from lightning_zeromoe._private import torch as _torch_private
from lightning_zeromoe._private.lightning import PARENT_PRIVATE_API
from lightning_zeromoe.strategy import ZeroMoEStrategy


def test_private_parent_hooks_we_override_still_exist():
    parent = DeepSpeedStrategy(config={})
    missing = [name for name in PARENT_PRIVATE_API if not hasattr(DeepSpeedStrategy, name)
               and not hasattr(parent, name)]
    assert not missing, f"lightning's DeepSpeedStrategy no longer has {missing}: re-check ZeroMoEStrategy"
    ours = [n for n, v in vars(ZeroMoEStrategy).items() if n.startswith("_") and not n.startswith("__")
            and callable(v) and hasattr(DeepSpeedStrategy, n)]
    assert set(ours) <= set(PARENT_PRIVATE_API), f"override not listed: {set(ours) - set(PARENT_PRIVATE_API)}"


def test_every_overridden_hook_is_marked_override():
    """typing_extensions.override sets __override__ on the function."""
    unmarked = []
    for name, value in vars(ZeroMoEStrategy).items():
        func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if isinstance(value, property) or not callable(func) or name.startswith("__"):
            continue
        if any(name in vars(base) for base in ZeroMoEStrategy.__mro__[1:]):
            if not getattr(func, "__override__", False):
                unmarked.append(name)
    assert not unmarked, f"overridden without @override: {unmarked}"


def test_torch_private_c10d_api_is_present():
    assert _torch_private.missing_private_api() == [], "torch removed a private c10d API ZeroMoEStrategy needs"


def test_torch_private_calls_work_on_a_real_group(tmp_path):
    """One-rank gloo group in a subprocess-free way: create, set, read back, destroy."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(minutes=3))
    try:
        sub = dist.new_group([0])
        assert sub in _torch_private.groups_of_this_rank()
        _torch_private.set_group_timeout(timedelta(seconds=42), sub)
        assert _torch_private.group_timeout(sub) == timedelta(seconds=42)
        assert _torch_private.group_timeout(dist.group.WORLD) == timedelta(minutes=3)
    finally:
        dist.destroy_process_group()


def test_only_deepspeeds_hooks_are_removed_before_an_evaluation_engine():
    """Lightning's ``remove_module_hooks`` empties every hook table; ours keeps what DeepSpeed did not
    register: Hugging Face's output capture (``output_router_logits``) and the user's own hooks."""
    import functools

    from deepspeed.runtime.zero import parameter_offload  # a module that defines DeepSpeed's hooks
    from transformers.utils import output_capturing

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    seen = []

    def user_hook(module, args, output):
        seen.append(type(module).__name__)

    ds_hook = functools.partial(parameter_offload.DeepSpeedZeRoOffload.destroy)  # any function DeepSpeed defined
    model[0].register_forward_hook(user_hook)
    model[0].register_forward_pre_hook(ds_hook, with_kwargs=True)
    model[1].register_forward_hook(ds_hook)
    model[1].register_full_backward_hook(ds_hook)
    output_capturing.install_output_capuring_hook(model[1], "router_logits", 0)

    assert _torch_private.remove_hooks_defined_in(model, "deepspeed") == 3
    assert list(model[0]._forward_hooks.values()) == [user_hook]
    assert not model[0]._forward_pre_hooks and not model[0]._forward_pre_hooks_with_kwargs
    assert [h.__name__ for h in model[1]._forward_hooks.values()] == ["output_capturing_hook"]
    assert not model[1]._backward_hooks and model[1]._is_full_backward_hook is None
    model(torch.ones(1, 2))
    assert seen == ["Linear"]
