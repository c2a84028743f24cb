"""Around the DeepSpeed engine: its build, param groups, processes, collectives, ZeRO-3 pitfalls.

What the strategy uses at import is exported here; each name lives in the module named for its concept.
"""

from lightning_zeromoe.engine import flight_recorder
from lightning_zeromoe.engine.build import autoep_converted, initialize
from lightning_zeromoe.engine.processes import (apply_timeout_to_all_groups, device_memory_bytes, group_timeout,
                                                release_cpu_allreduce_buffer, stop_launched_ranks,
                                                use_deepspeed_cpu_accelerator)

__all__ = ["apply_timeout_to_all_groups", "autoep_converted", "device_memory_bytes", "flight_recorder", "group_timeout",
           "initialize", "release_cpu_allreduce_buffer", "stop_launched_ranks", "use_deepspeed_cpu_accelerator"]
