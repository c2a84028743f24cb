"""Every ``DeepSpeedStrategy`` keyword is passed on, mapped into the built config, or refused (pure, in-process)."""

from __future__ import annotations

import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_zeromoe import ZeroMoEStrategy
from lightning_zeromoe.config.keywords import CONFIG_ENV_VAR, MAPPED, OWN_PARAMETERS, PASSED_TO_LIGHTNING, REFUSED
from lightning_zeromoe.reference.models import TinyMoEModule
from lightning_zeromoe.config.validation import ZeroMoEConfigError


@pytest.fixture(autouse=True)
def no_process_group_after():
    yield
    assert not torch.distributed.is_initialized(), "keyword handling must not create a process group"


def prepared(strategy: ZeroMoEStrategy, devices: int = 2) -> ZeroMoEStrategy:
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)
    module = TinyMoEModule()
    module.trainer = trainer
    strategy.connect(module)
    strategy.prepare()
    return strategy


def test_every_lightning_keyword_is_in_exactly_one_table():
    """A keyword a new Lightning adds to DeepSpeedStrategy.__init__ fails here until it is sorted."""
    names = set(inspect.signature(DeepSpeedStrategy.__init__).parameters) - {"self"}
    tables = [PASSED_TO_LIGHTNING, OWN_PARAMETERS, set(MAPPED), set(REFUSED)]
    unsorted = names - set().union(*tables)
    assert not unsorted, f"DeepSpeedStrategy keywords neither passed on, mapped nor refused: {sorted(unsorted)}"
    for a in range(len(tables)):
        for b in range(a + 1, len(tables)):
            assert not set(tables[a]) & set(tables[b]), (tables[a], tables[b])
    own = set(inspect.signature(ZeroMoEStrategy.__init__).parameters)
    assert OWN_PARAMETERS <= own, OWN_PARAMETERS - own


#: A non-default value for every mapped keyword, and where it must land in the built config.
MAPPED_VALUES = {
    "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
    "synchronize_checkpoint_boundary": True, "block_size": 4096, "queue_depth": 4, "single_submit": True,
    "overlap_events": False, "thread_count": 2, "sub_group_size": 12345, "allgather_partitions": False,
    "reduce_scatter": False, "zero_allow_untested_optimizer": False, "logging_batch_size_per_gpu": 3,
    "offload_optimizer_device": "nvme", "optimizer_buffer_count": 7, "offload_params_device": "nvme",
    "params_buffer_count": 6, "params_buffer_size": 1000, "max_in_cpu": 99, "nvme_path": "/tmp/nvme",
}


def _lookup(config: dict, section: str, key: str) -> list:
    if section == "zero_optimization.offload_*":
        return [config["zero_optimization"][s][key] for s in ("offload_optimizer", "offload_param")]
    node = config
    for part in filter(None, section.split(".")):
        node = node[part]
    return [node[key]]


def test_each_mapped_keyword_reaches_the_built_config():
    assert set(MAPPED_VALUES) == set(MAPPED)
    strategy = prepared(ZeroMoEStrategy(ep_size=2, offload_optimizer=True, offload_parameters=True, **MAPPED_VALUES))
    for name, value in MAPPED_VALUES.items():
        assert _lookup(strategy.config, *MAPPED[name]) == [value] * len(_lookup(strategy.config, *MAPPED[name])), name
    checkpointing = strategy.config["activation_checkpointing"]
    assert checkpointing == {"partition_activations": True, "cpu_checkpointing": True,
                             "contiguous_memory_optimization": True, "synchronize_checkpoint_boundary": True}


def test_passed_keywords_reach_the_parent():
    strategy = ZeroMoEStrategy(ep_size=1, loss_scale=128.0, hysteresis=3, load_full_weights=True,
                               remote_device="cpu", exclude_frozen_parameters=True)
    assert (strategy.loss_scale, strategy.hysteresis, strategy.load_full_weights) == (128.0, 3, True)
    assert strategy.remote_device == "cpu" and strategy.exclude_frozen_parameters


def test_zero_optimization_keyword_is_refused_naming_stage_0():
    with pytest.raises(ZeroMoEConfigError, match=r"^\[strategy-keyword-refused\] .*zero_optimization=False.*stage=0"):
        ZeroMoEStrategy(zero_optimization=False)


@pytest.mark.parametrize("kwargs, needs", [
    ({"offload_optimizer_device": "nvme"}, "offload_optimizer"),
    ({"max_in_cpu": 10}, "offload_parameters"),
    ({"nvme_path": "/x"}, "offload_optimizer"),
])
def test_offload_keywords_without_offload_are_refused(kwargs, needs):
    with pytest.raises(ZeroMoEConfigError, match=rf"^\[strategy-keyword-refused\] .*ZeroMoEStrategy\({needs}=True"):
        ZeroMoEStrategy(**kwargs)


def test_unknown_keyword_is_still_a_type_error():
    with pytest.raises(TypeError, match="no_such_option"):
        ZeroMoEStrategy(no_such_option=1)


def test_config_path_env_var_is_read_when_no_config_is_passed(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"reduce_bucket_size": 777}}')
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    assert prepared(ZeroMoEStrategy(ep_size=2)).config["zero_optimization"]["reduce_bucket_size"] == 777
    # An explicit config wins, as in Lightning.
    explicit = prepared(ZeroMoEStrategy(ep_size=2, config={"zero_optimization": {"reduce_bucket_size": 5}}))
    assert explicit.config["zero_optimization"]["reduce_bucket_size"] == 5
