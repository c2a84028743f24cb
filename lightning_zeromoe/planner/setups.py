"""Precisions, bytes per element, and the setups (stage x offload) the planner compares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


GB = 10**9
GIB = 2**30

#: (weight, gradient, master weight) bytes per element. The optimizer adds ``optimizer_bytes``.
_PRECISION_BYTES = {"fp32": (4, 4, 4), "bf16": (2, 2, 4), "fp16": (2, 2, 4)}
_PRECISION_ALIASES = {
    "32": "fp32", "32-true": "fp32", "fp32": "fp32", "float32": "fp32",
    "bf16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16", "bfloat16": "bf16",
    "16": "fp16", "16-mixed": "fp16", "16-true": "fp16", "fp16": "fp16", "float16": "fp16",
}

#: DeepSpeed stage 1/2 pads each flat parameter group to a multiple of this times the group size
#: (``nccl_start_alignment_factor`` in ``stage_1_and_2.py``).
_STAGE12_ALIGNMENT = 2


def normalize_precision(precision: str | int) -> str:
    """Lightning's and DeepSpeed's precision spellings -> ``fp32`` | ``bf16`` | ``fp16``."""
    key = str(precision).lower()
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(_PRECISION_ALIASES)}")
    return _PRECISION_ALIASES[key]


# ---------------------------------------------------------------------------------------- setups

@dataclass(frozen=True, order=True)
class Setup:
    """One ZeRO configuration. Ordered from least to most aggressive (more communication, or
    PCIe traffic and CPU optimizer time), which is the order :meth:`Plan.recommend` tries them."""

    rank: int
    stage: int
    offload_optimizer: bool = False
    offload_parameters: bool = False

    @property
    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer:
            parts.append("offload optimizer")
        if self.offload_parameters:
            parts.append("offload params")
        return " + ".join(parts)

    def strategy_kwargs(self) -> dict[str, Any]:
        """The ``ZeroMoEStrategy`` arguments for this setup."""
        return {"stage": self.stage, "offload_optimizer": self.offload_optimizer,
                "offload_parameters": self.offload_parameters}


#: The seeds' advice: no ZeRO-3 while 1 or 2 fits, no offload while anything on-device fits.
LADDER = (
    Setup(0, 1), Setup(1, 2), Setup(2, 3),
    Setup(3, 2, offload_optimizer=True), Setup(4, 3, offload_optimizer=True),
    Setup(5, 3, offload_optimizer=True, offload_parameters=True),
)
