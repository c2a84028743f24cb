"""The planner's facts of the configs under examples/configs, built once per test session (a meta-device
build of Mixtral-8x7B or Qwen3-30B-A3B takes seconds; several tests print reports from them)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from support.jobs import REPO


@lru_cache(maxsize=None)
def example_facts(config: str) -> Any:
    """``cli.model_facts`` of ``examples/configs/{config}.json``."""
    from lightning_zeromoe.planner import cli

    return cli.model_facts(cli.load_config(str(REPO / "examples/configs" / f"{config}.json")))
