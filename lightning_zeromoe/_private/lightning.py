"""The only place that touches Lightning's private names (lightning 2.6.6 is what they were read from).

``ZeroMoEStrategy`` subclasses ``DeepSpeedStrategy`` and overrides some of its private hooks
(:data:`PARENT_PRIVATE_API`; an override and its ``super()`` call are part of subclassing and stay
in the strategy). Everything else the strategy reads or sets on Lightning's objects goes through
the functions here:

* ``DeepSpeedStrategy._config_initialized``: cleared so Lightning fills in batch size,
  accumulation, clipping and precision on the config we built;
* ``DeepSpeedStrategy._init_deepspeed_distributed``: joins the process group (CPU: gloo);
* ``DDPStrategy._timeout``: the collective timeout the strategy was given;
* ``LightningModule._trainer``: the trainer, without the error ``.trainer`` raises when there is none;
* ``strategies.deepspeed._validate_checkpoint_directory``: Lightning's check of a ``ckpt_path``.

Lightning is imported inside each function: ``troubleshooter``'s start path must not load it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

#: Private ``DeepSpeedStrategy`` members ``ZeroMoEStrategy`` overrides or relies on.
PARENT_PRIVATE_API = ("_configure_launcher", "_setup_model_and_optimizer", "_initialize_deepspeed_inference",
                      "_init_deepspeed_distributed", "_config_initialized", "_set_deepspeed_activation_checkpointing")
NAMES = (*PARENT_PRIVATE_API, "_timeout", "_trainer", "_validate_checkpoint_directory")


def missing() -> list[str]:
    """The private Lightning names this installation lacks (empty when everything is there)."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies import DeepSpeedStrategy, deepspeed

    strategy = DeepSpeedStrategy(config={})
    gone = [f"DeepSpeedStrategy.{name}" for name in PARENT_PRIVATE_API
            if not hasattr(DeepSpeedStrategy, name) and not hasattr(strategy, name)]
    if not hasattr(strategy, "_timeout"):
        gone.append("DDPStrategy._timeout")
    if "_trainer" not in vars(LightningModule()):
        gone.append("LightningModule._trainer")
    if not callable(getattr(deepspeed, "_validate_checkpoint_directory", None)):
        gone.append("strategies.deepspeed._validate_checkpoint_directory")
    return gone


def rebuild_config(strategy: Any) -> None:
    """Have Lightning complete ``strategy.config`` again (batch size, accumulation, clipping, precision)."""
    strategy._config_initialized = False


def init_distributed(strategy: Any) -> None:
    """``DeepSpeedStrategy``'s own process-group set-up, without its CUDA device check."""
    strategy._init_deepspeed_distributed()


def collective_timeout(strategy: Any) -> timedelta | None:
    """The collective timeout the strategy was constructed with."""
    return strategy._timeout


def trainer_of(module: Any) -> Any:
    """The module's trainer, or ``None`` when it is not attached to one."""
    return getattr(module, "_trainer", None)


def validate_checkpoint_directory(path: Any) -> None:
    """Lightning's check that ``path`` is a DeepSpeed checkpoint directory (a clear error otherwise)."""
    from lightning.pytorch.strategies.deepspeed import _validate_checkpoint_directory

    _validate_checkpoint_directory(path)
