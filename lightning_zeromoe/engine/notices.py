"""Silence third-party notices that are noise for a user of this package, each one narrowly.

:func:`silence_known_notices` installs one filter per notice, matched by its message (and category
or logger), never a blanket filter: any other warning still shows. What each one is, and why it
can go:

* torch ``FutureWarning`` "`isinstance(treespec, LeafSpec)` is deprecated" (Lightning 2.6's own
  ``utilities/_pytree.py`` uses the old spelling; nothing a user can change).
* Lightning's "When saving the DeepSpeed Stage 3 checkpoint ... single file ... see
  https://lightning.ai/..." hint: it points to ``convert_zero_checkpoint_to_fp32_state_dict``,
  which refuses AutoEP checkpoints. Our output says to use ``zeromoe-export`` instead.
* Lightning's "💡 Tip: ... litlogger" line, logged at every ``Trainer`` start.

Two more notices are avoided at their source rather than filtered: Lightning's "`weights_only` was
not set" (pass ``weights_only=`` to ``trainer.save_checkpoint``) and torch's "Failed to initialize
NumPy" (numpy is a dependency of this package; DeepSpeed and transformers need it anyway).
"""

from __future__ import annotations

import logging
import warnings

#: Start of Lightning's litlogger tip (lightning/pytorch/trainer/connectors/logger_connector).
LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"
#: Loggers Lightning's rank_zero_info writes through: lightning_utilities' module-level ``log``, which
#: lightning.fabric and then lightning.pytorch each point at their own ``utilities.rank_zero`` logger.
RANK_ZERO_LOGGERS = ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                     "lightning_utilities.core.rank_zero")


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_known_notices() -> None:
    """Install the filters described in the module docstring (idempotent)."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"When saving the DeepSpeed Stage 3 checkpoint, each worker will save",
                            category=UserWarning)
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(LITLOGGER_TIP))


__all__ = ["silence_known_notices"]
