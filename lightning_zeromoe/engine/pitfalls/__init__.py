"""ZeRO-3 pitfalls the strategy detects, handles or stops: shared weights, moves in forward, stale copies.

Every function here was written against DeepSpeed 0.19.8's stage-3 code and checked on 2 CPU ranks
(``tests/test_pitfalls.py``). One module per concern: :mod:`.sharing` (shared weights),
:mod:`.device_guard` (moves in forward, buffers), :mod:`.grad_audit` (stale copies), and
:mod:`.lifecycle`, the typed object the strategy calls at each hook. What DeepSpeed does, and where:

* **Shared weights.** ``DeepSpeedZeRoOffload`` (``runtime/zero/parameter_offload.py``) swaps every
  module's ``_parameters`` for a ``ZeROOrderedDict``. While ``DeepSpeedEngine.forward`` runs
  (``_forward_prologue`` sets ``_parameters._in_forward``), reading a parameter that is still
  partitioned through that dict calls ``register_external_parameter(FWD_MODULE_STACK[-1], param)``
  and a *synchronous* ``param.all_gather()``: the parameter is attached to whichever module is
  running. The registration lives in ``module._external_params`` (``ds_external_parameters()``),
  and ``PartitionedParameterCoordinator.fetch_sub_module`` fetches ``named_parameters(recurse=False)``
  plus those external parameters from then on, so after the first step it is prefetched like any
  other. A module that *returns* a parameter gets it registered with ``is_external_param = True``,
  and the coordinator never releases such a parameter. A parameter held by two modules (a tied
  embedding / lm_head) is simply in both modules' ``named_parameters``: no external path at all.
  Measured on the tiny model (``tests/jobs/pitfall_raw.py``, one functionally used parameter):
  explicit registration saves exactly one synchronous gather and one collective, on the first
  step only; from step 2 the counts are identical. For a tied lm_head it changes nothing.
* **Moves in forward.** A ZeRO-3 parameter is a placeholder whose ``.data`` is swapped between an
  empty tensor and a gathered copy; the real storage is ``param.ds_tensor``, a slice of the flat
  partition the optimizer updates. ``Module.to``/``half``/... rebind ``param.data`` only, which
  detaches the module from its partition (:class:`DeviceMoveGuard`). Under ``zero.Init`` the engine
  also skips ``module.to(device)`` (``DeepSpeedEngine._configure_distributed_model``), so buffers
  stay where they were created (:func:`move_buffers_to_device`).
* **Stale copies.** Stage 3 learns that a gradient is ready from a post-accumulate-grad hook on each
  parameter (``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks`` via
  ``deepspeed.utils.torch.register_grad_hook``) and moves it into its grad partition
  (``__param_id_to_grad_partition``), leaving ``param.grad`` empty. :class:`GradAudit` watches the
  same event for the first K optimizer steps, then removes its hooks.
"""

from lightning_zeromoe.engine.pitfalls.device_guard import MOVE_METHODS, DeviceMoveGuard, ZeroDeviceMoveError, move_buffers_to_device
from lightning_zeromoe.engine.pitfalls.grad_audit import AliasedAttribute, AuditReport, GradAudit, StaleParameter
from lightning_zeromoe.engine.pitfalls.lifecycle import PitfallOptions, PitfallState, ZeroPitfalls
from lightning_zeromoe.engine.pitfalls.sharing import (ExternalUse, TiedParameter, broken_ties, describe_sharing,
                                                find_external_uses, find_tied_parameters, parameter_paths,
                                                register_shared_parameters)

__all__ = [
    "MOVE_METHODS", "AliasedAttribute", "AuditReport", "DeviceMoveGuard", "ExternalUse", "GradAudit", "PitfallOptions",
    "PitfallState", "StaleParameter", "TiedParameter", "ZeroDeviceMoveError", "ZeroPitfalls", "broken_ties",
    "describe_sharing", "find_external_uses", "find_tied_parameters", "move_buffers_to_device", "parameter_paths",
    "register_shared_parameters",
]
