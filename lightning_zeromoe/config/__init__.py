"""Options to a resolved, checked DeepSpeed config: sections, keywords, validation.

What the strategy uses is exported here; each name lives in the module named for its concept.
"""

from lightning_zeromoe.config.before_model import builds_in_configure_model, options_before_model
from lightning_zeromoe.config.deepspeed import DEFAULT_BUCKET_SIZE
from lightning_zeromoe.config.native_moe import native_ep, native_ep_sizes, native_plan_counts
from lightning_zeromoe.config.options import strategy_settings
from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.config.resolve import (ResolvedConfig, World, check_offload_optimizer, effective_ep_size,
                                              effective_stage, inference_config, resolve, user_section,
                                              zero_init_config)
from lightning_zeromoe.config.validation import ZeroMoEConfigError, check_ep_divides_world

__all__ = ["DEFAULT_BUCKET_SIZE", "DeepSpeedConfig", "ResolvedConfig", "World", "ZeroMoEConfigError",
           "builds_in_configure_model", "check_ep_divides_world", "check_offload_optimizer", "effective_ep_size",
           "effective_stage", "inference_config", "native_ep", "native_ep_sizes", "native_plan_counts",
           "options_before_model", "resolve", "strategy_settings", "user_section", "zero_init_config"]
