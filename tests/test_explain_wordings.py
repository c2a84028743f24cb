"""explain on wordings the first patterns did not cover, shaped like what users paste: rank
prefixes, cut excerpts, rich tracebacks, timestamps. Every text here was written for its test
(from the installed libraries' own message strings), none is a copied report.

Covered: ZeRO-3 placeholders in shape errors (a 0 or 1 where a real dimension belongs, next to a
ZeRO-3 frame or config); a stale JIT lock only when nothing after it shows progress; fp16
overflows counted against steps; fixes the log shows were already followed or cannot help; a
rank's own C++ abort before its peer's 'Connection reset by peer'; the new entries (native MoE
gating, ds_to_universal, NCCL inside an all-to-all, parameters ZeRO-3 never converted, router
collapse read from printed loads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from troubleshooter import explain, knowledge


def top(text: str) -> explain.Diagnosis:
    """The first diagnosis (failing when there is none)."""
    found = explain.explain_text(text)
    assert found, "nothing matched"
    return found[0]


def ids(text: str) -> list[str]:
    """The entry ids explain names, best first."""
    return [d.entry_id for d in explain.explain_text(text)]


# --------------------------------------------------------------------------- 1. ZeRO-3 placeholders

HF_BACKWARD = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/workspace/sft/train.py", line 212, in <module>
[rank1]:     trainer.train()
[rank1]:   File "/opt/venv/lib/python3.10/site-packages/transformers/trainer.py", line 2325, in _inner_training_loop
[rank1]:     tr_loss_step = self.training_step(model, inputs, num_items_in_batch)
[rank1]:   File "/opt/venv/lib/python3.10/site-packages/accelerate/accelerator.py", line 2730, in backward
[rank1]:     self.deepspeed_engine_wrapped.backward(loss, **kwargs)
[rank1]:   File "/opt/venv/lib/python3.10/site-packages/deepspeed/runtime/engine.py", line 2298, in backward
[rank1]:     self.optimizer.backward(loss, retain_graph=retain_graph)
[rank1]:   File "/opt/venv/lib/python3.10/site-packages/deepspeed/runtime/zero/stage3.py", line 2270, in backward
[rank1]:     self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)
[rank1]:   File "/opt/venv/lib/python3.10/site-packages/torch/autograd/graph.py", line 825, in _engine_run_backward
[rank1]:     return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass
[rank1]: RuntimeError: The size of tensor a (5120) must match the size of tensor b (0) at non-singleton dimension 1
"""

LIGHTNING_OFFLOAD = """\
Epoch 0:   0%|          | 0/3125 [00:00<?, ?it/s] \
╭───────────────────── Traceback (most recent call last) ──────────────────────╮
│ /home/kim/proj/fit.py:88 in <module>                                         │
│                                                                              │
│   85 │   trainer = L.Trainer(accelerator="gpu", devices=4,                   │
│   86 │   │   │   │   │   │   strategy="deepspeed_stage_3_offload",           │
│   87 │   │   │   │   │   │   precision="16-mixed")                           │
│ ❱ 88 │   trainer.fit(model, datamodule=dm)                                   │
│                                                                              │
│ /home/kim/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py:353  │
│ in backward                                                                  │
╰──────────────────────────────────────────────────────────────────────────────╯
RuntimeError: The size of tensor a (0) must match the size of tensor b
(2048) at non-singleton dimension 0
"""

TIED_WEIGHT = """\
(cut) config I pass to deepspeed.initialize:
    {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4}}
...
  File "/data/code/mymodel/modeling.py", line 341, in tie_output_layer
    self.lm_head.weight.data.copy_(self.embed_tokens.weight.data)
RuntimeError: output with shape [1] doesn't match the broadcast shape [32000, 4096]
"""


@pytest.mark.parametrize("text", [HF_BACKWARD, LIGHTNING_OFFLOAD, TIED_WEIGHT],
                         ids=["hf-backward-rank-prefixed", "lightning-stage3-offload-rich-box", "tied-weight-cut"])
def test_shape_errors_with_a_zero3_placeholder_are_partitioned_parameters(text):
    d = top(text)
    assert d.entry_id == "zero3-param-not-available" and d.family == "zero3-pitfalls"
    assert "gather-parameters" in d.fix_ids


def test_the_same_shape_error_without_zero3_or_without_a_placeholder_is_not_that():
    plain = "RuntimeError: The size of tensor a (5120) must match the size of tensor b (0) at non-singleton dimension 1\n"
    assert "zero3-param-not-available" not in ids(plain)  # no ZeRO-3 frame or config nearby
    real_mismatch = HF_BACKWARD.replace("tensor b (0)", "tensor b (4096)")
    assert "zero3-param-not-available" not in ids(real_mismatch)  # a real dimension: a real bug


# --------------------------------------------------------------------------- 2. stale JIT lock

ROOT = "Using /root/.cache/torch_extensions/py310_cu118 as PyTorch extensions root...\n"


def test_a_lock_is_stale_only_when_nothing_after_it_shows_progress():
    assert top("[2026-12-02 07:00:01,002] [INFO] [comm.py:700:init_distributed] Initializing TorchBackend\n"
               + ROOT + "[rank3]:" + ROOT).entry_id == "stale-extension-lock"
    for progress in ("Loading extension module fused_adam...\n",
                     "Time to load fused_adam op: 24.13 seconds\n",
                     "Emitting ninja build file /root/.cache/torch_extensions/py310_cu118/fused_adam/build.ninja...\n"
                     "Building extension module fused_adam...\n[1/2] /usr/local/cuda/bin/nvcc -c multi_tensor_adam.cu\n"):
        assert "stale-extension-lock" not in ids(ROOT + progress), progress


def test_interrupting_the_wait_shows_the_lock():
    text = (ROOT + "^CTraceback (most recent call last):\n"
            '  File "/usr/lib/python3.10/site-packages/torch/utils/cpp_extension.py", line 1815, in _jit_compile\n'
            "    baton.wait()\n"
            '  File "/usr/lib/python3.10/site-packages/torch/utils/file_baton.py", line 42, in wait\n'
            "    time.sleep(self.wait_seconds)\nKeyboardInterrupt\n")
    assert top(text).entry_id == "stale-extension-lock"


# --------------------------------------------------------------------------- 3. fp16 overflows

def _overflow(attempted: int, reduced: int) -> str:
    return (f"[2026-12-02 11:02:{attempted % 60:02d},100] [INFO] [loss_scaler.py:266:update_scale] "
            f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {attempted}, reducing to {reduced}\n")


def test_the_loss_scale_search_at_the_start_is_not_a_problem():
    start = "".join(_overflow(2 ** p, 2 ** (p - 1)) for p in range(16, 11, -1))
    assert "fp16-moe" not in ids(start)  # a cut excerpt: five halvings, nothing else
    counted = start + "[Rank 0] step=10, skipped=5, lr=[3e-05], mom=[(0.9, 0.999)]\n" \
                      "[Rank 0] step=20, skipped=5, lr=[3e-05], mom=[(0.9, 0.999)]\n"
    assert "fp16-moe" not in ids(counted)


def test_a_longer_search_from_two_to_the_32_is_discounted_not_counted_against_the_steps():
    """An HF Trainer paste (tqdm steps, no DeepSpeed counters) cut at step 24 of a search from 2^32."""
    lines = []
    for i, power in enumerate(range(32, 15, -1)):
        lines.append(f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {2 ** power}, "
                     f"reducing to {2 ** (power - 1)}")
        lines.append(f"  2%|▏         | {i + 1}/1000 [00:{i + 10}<12:00,  1.31it/s]")
    lines += [f"  2%|▏         | {k}/1000 [00:30<12:00,  1.31it/s]" for k in range(18, 25)]
    assert "fp16-moe" not in ids("\n".join(lines))
    again = "\n".join(lines[:12:2] + [f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {2 ** p}, "
                                     f"reducing to {2 ** (p - 1)}" for p in range(28, 20, -1)])
    d = top(again)  # no step counter at all: the scale grew back, then fell 8 times in a row
    assert d.entry_id == "fp16-moe" and "fell again 8 times" in d.finding


def test_a_scale_that_falls_to_its_minimum_is_a_collapse_and_the_title_does_not_say_moe():
    llama = ("loading meta-llama/Llama-2-13b-hf (dense)\n"
             + "".join(_overflow(2 ** p, 2 ** (p - 1)) for p in range(16, 10, -1))
             + "[Rank 0] step=100, skipped=6, lr=[2e-05]\n"
             + "".join(_overflow(2 ** p, 2 ** (p - 1)) for p in range(11, 0, -1)))
    d = top(llama)
    assert d.entry_id == "fp16-moe" and "MoE" not in d.title
    assert "fell to 1" in d.finding and "use-bf16" in d.fix_ids


def test_skipped_steps_that_do_not_stop_are_a_collapse():
    stream = ("[Rank 0] step=50, skipped=6, lr=[1e-05]\n"
              + "".join(f"[2026-12-02 11:1{i}:00,000] [INFO] [loss_scaler.py:280:update_scale] [deepspeed] OVERFLOW! "
                        "Rank 0 Skipping step. Attempted loss scale: 1024, but hysteresis is 2. Reducing hysteresis to 1\n"
                        for i in range(3))
              + "[Rank 0] step=60, skipped=16, lr=[1e-05]\n[Rank 0] step=70, skipped=26, lr=[1e-05]\n")
    d = top(stream)
    assert d.entry_id == "fp16-moe" and "10 of the last 10 steps" in d.finding
    assert "fp16-moe" in ids("FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding.\n")


# --------------------------------------------------------------------------- 4. advice already followed

TORCH_CUDA_CHECK = """\
+ export DS_BUILD_OPS=1
+ export DS_SKIP_CUDA_CHECK=1
+ pip install deepspeed==0.19.8 --no-build-isolation
  running build_ext
  Traceback (most recent call last):
    File "/opt/conda/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 815, in build_extensions
      _check_cuda_version(compiler_name, compiler_version)
    File "/opt/conda/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 646, in _check_cuda_version
      raise RuntimeError(CUDA_MISMATCH_MESSAGE, cuda_str_version, torch.version.cuda)
  RuntimeError: ('The detected CUDA version (%s) mismatches the version that was used to compilePyTorch (%s). \
Please make sure to use the same CUDA versions.', '13.0', '12.8')
  error: subprocess-exited-with-error
"""


def test_a_variable_the_log_already_sets_is_not_proposed_and_the_check_it_cannot_bypass_is_named():
    text = TORCH_CUDA_CHECK.replace("(%s). ", "(12.8). ").replace("(%s)", "(13.0)")
    d = top(text)
    assert d.entry_id == "cuda-version-mismatch" and "skip-cuda-check" not in d.fix_ids
    assert "already sets DS_SKIP_CUDA_CHECK=1" in d.finding
    assert "cannot bypass" in d.finding and "_check_cuda_version" in d.finding
    assert all("DS_SKIP_CUDA_CHECK" not in fix for fix in d.fix)


def test_deepspeeds_own_check_still_gets_the_bypass_and_a_hint_in_a_message_is_not_a_setting():
    ds = ("deepspeed.ops.op_builder.builder.CUDAMismatchException: >- DeepSpeed Op Builder: Installed CUDA "
          "version 12.2 does not match the version torch was compiled with 11.8, unable to compile cuda/cpp "
          "extensions without a matching cuda version.\n")
    assert "skip-cuda-check" in top(ds).fix_ids
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "79.10 GiB of which 1.20 GiB is free. Of the allocated memory 70.11 GiB is allocated by PyTorch, and "
           "6.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\n")
    assert top(oom).fix_ids[0] == "expandable-segments"
    already = "$ export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n$ torchrun train.py\n" + oom
    d = top(already)
    assert "expandable-segments" not in d.fix_ids and "Line 1 already sets PYTORCH_CUDA_ALLOC_CONF" in d.finding


# --------------------------------------------------------------------------- 7. a rank's own abort

GLOO_ABORT = """\
[rank0]:[W1202 14:10:41.212000000 ProcessGroupGloo.cpp:516] Warning: step 37
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length \
<= op.nbytes. 65536 vs 32768. Received data size doesn't match expected size. Is there a distributed \
collective mismatch in your code?
[rank0]: Traceback (most recent call last):
[rank0]:   File "/srv/moe/train_moe.py", line 140, in <module>
[rank0]:     engine.backward(loss)
[rank0]:   File "/srv/venv/lib/python3.11/site-packages/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 431, in __all_gather_params_
[rank0]:     handle = param_group[0].all_gather_coalesced(param_group, quantize=quantize)
[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.1.0.5]:50522: Connection reset by peer
W1202 14:10:43.001000 91 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 97 closing signal SIGTERM
"""


def test_a_gloo_size_mismatch_abort_is_the_first_error_and_names_leaf_modules():
    found = explain.explain_text(GLOO_ABORT)
    own, echo = found[0], next(d for d in found if d.entry_id == "peer-rank-died")
    assert own.entry_id == "zero3-moe-gather-mismatch" and own.fix_ids[0] == "leaf-modules"
    assert "own error" in own.finding and "No rank's own error" not in echo.finding
    assert f"line {own.line_no}" in echo.finding
    assert "set_z3_leaf_modules" in own.fix[0] and "leaf_module" in own.fix[0]


def test_the_nccl_form_is_an_all_gather_timeout_with_different_sizes_on_different_ranks():
    def watchdog(rank: int, numel: int) -> str:
        return (f"[rank{rank}]:[E1202 15:00:0{rank}.000000000 ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught "
                f"collective operation timeout: WorkNCCL(SeqNum=4412, OpType=_ALLGATHER_BASE, NumelIn={numel}, "
                f"NumelOut={numel * 2}, Timeout(ms)=1800000) ran for 1800094 milliseconds before timing out.\n")
    mismatched = watchdog(0, 5767168) + watchdog(1, 2883584)
    found = explain.explain_text(mismatched)
    assert found[0].entry_id == "zero3-moe-gather-mismatch"
    assert {"zero3-moe-gather-mismatch", "nccl-watchdog-timeout"} <= {d.entry_id for d in found}
    assert top(watchdog(0, 5767168) + watchdog(1, 5767168)).entry_id == "nccl-watchdog-timeout"


def test_an_unknown_cpp_abort_before_a_peer_failure_is_named():
    text = ("terminate called after throwing an instance of 'c10::Error'\n"
            "  what():  CUDA error: an illegal memory access was encountered\n"
            "[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
            "[127.0.0.1]:41234: Connection reset by peer\n")
    [peer] = [d for d in explain.explain_text(text) if d.entry_id == "peer-rank-died"]
    assert "line 1" in peer.finding and "c10::Error" in peer.finding and "illegal memory access" in peer.finding


# --------------------------------------------------------------------------- 8. new entries

def test_native_moe_gating_asserts():
    assert_text = (
        '[rank2]:   File "/opt/venv/lib/python3.10/site-packages/deepspeed/moe/sharded_moe.py", line 278, in top1gating\n'
        "[rank2]:     assert logits.shape[\n[rank2]: AssertionError: No. of tokens (batch-size) should be greater than "
        "min_capacity. Either set min_capacity to 0 or increase your batch size.\n")
    d = top(assert_text)
    assert d.entry_id == "native-moe-gating-assert" and d.fix_ids[0] == "min-capacity-zero"
    one_hot = ('  File "/usr/local/lib/python3.9/dist-packages/deepspeed/moe/sharded_moe.py", line 346, in top2gating\n'
               "    mask2 = F.one_hot(indices2_s, num_classes=num_experts)\n"
               "RuntimeError: Class values must be smaller than num_classes.\n")
    assert top(one_hot).entry_id == "native-moe-gating-assert"
    assert "native-moe-gating-assert" not in ids("RuntimeError: Class values must be smaller than num_classes.\n")


DS_TO_UNIVERSAL = '''\
$ python deepspeed/checkpoint/ds_to_universal.py --input_folder ckpt/global_step2000 --output_folder ckpt/universal
*** 1. Extracting ZeRO fragments
100%|██████████| 8/8 [00:41<00:00,  5.2s/it]
*** 2. Merging slices .....
concurrent.futures.process._RemoteTraceback:
"""
Traceback (most recent call last):
  File "/usr/lib/python3.10/concurrent/futures/process.py", line 246, in _process_worker
    r = call_item.fn(*call_item.args, **call_item.kwargs)
  File "/opt/ds/deepspeed/checkpoint/ds_to_universal.py", line 531, in merge_tp_slices
    slices = _merge_zero_shards(slice_base_path, state, tp_degree, shape)
  File "/opt/ds/deepspeed/checkpoint/ds_to_universal.py", line 278, in _merge_zero_shards
    slice = torch.cat(shards, dim=0).reshape(slice_shapes[tp_index])
RuntimeError: shape '[14336, 4096]' is invalid for input of size 51380224
"""
'''


def test_ds_to_universal_and_zero_to_fp32_failures():
    assert top(DS_TO_UNIVERSAL).entry_id == "ds-to-universal-mismatch"
    count = ("RuntimeError: ZeRO-3 checkpoint model/optimizer rank sets do not match: model_only=[4, 5, 6, 7], "
             "optim_only=[]\n")
    assert top(count).entry_id == "ds-to-universal-mismatch"
    fp32 = ('  File "/opt/venv/lib/python3.11/site-packages/lightning/pytorch/utilities/deepspeed.py", line 104, in convert_zero_checkpoint_to_fp32_state_dict\n'
            "    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)\n"
            '  File "/opt/venv/lib/python3.11/site-packages/deepspeed/utils/zero_to_fp32.py", line 336, in _zero2_merge_trainable_params\n'
            "    state_dict[name] = full_single_fp32_vector.narrow(0, offset, unpartitioned_numel).view(shape)\n"
            "RuntimeError: start (7340032) + length (4194304) exceeds dimension size (9437184).\n")
    assert top(fp32).entry_id == "zero-to-fp32-mismatch"


ALL_TO_ALL = """\
[rank5]:   File "/opt/venv/lib/python3.10/site-packages/deepspeed/moe/sharded_moe.py", line 104, in forward
[rank5]:     dist.all_to_all_single(output, input, group=group)
[rank5]:   File "/opt/venv/lib/python3.10/site-packages/torch/distributed/distributed_c10d.py", line 4157, in all_to_all_single
[rank5]:     work = group.alltoall_base(
[rank5]: torch.distributed.DistBackendError: NCCL error in: /opt/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, \
internal error - please report this issue to the NCCL developers, NCCL version 2.21.5
[rank5]: ncclInternalError: Internal check failed.
[rank5]: Last error:
[rank5]: Proxy Call to rank 12 failed (Connect)
"""


def test_nccl_internal_error_inside_the_all_to_all():
    d = top(ALL_TO_ALL)
    assert d.entry_id == "nccl-all-to-all-error" and d.family == "host"
    elsewhere = ALL_TO_ALL.replace("all_to_all_single", "all_reduce").replace("alltoall_base", "allreduce") \
                          .replace("dist.all_to_all_single(output, input, group=group)", "dist.all_reduce(t)")
    assert "nccl-all-to-all-error" not in ids(elsewhere)


def test_parameters_zero3_never_converted():
    missing = ('[rank0]:   File "/opt/venv/lib/python3.10/site-packages/deepspeed/runtime/zero/stage3.py", line 1022, in _create_fp16_partitions_with_defragmentation\n'
               "[rank0]:     self._param_slice_mappings = self._create_param_mapping()\n"
               "[rank0]: AttributeError: 'Parameter' object has no attribute 'ds_numel'\n")
    assert top(missing).entry_id == "zero3-param-not-converted"
    fan_in = ("[2026-12-02 16:20:01,117] [INFO] [partition_parameters.py:348:__exit__] finished initializing model - "
              "num_params = 291, num_elems = 7.24B\n"
              '  File "/workspace/model.py", line 77, in _init_weights\n    nn.init.xavier_uniform_(module.weight)\n'
              "ValueError: Fan in and fan out can not be computed for tensor with fewer than 2 dimensions\n")
    assert top(fan_in).entry_id == "zero3-param-not-converted"


COLLAPSED_TABLE = """\
[rank0]: step 3400 | loss 4.913 | aux_loss 0.0003
                Expert load, layer 11 (step 3400)
┏━━━━━━━━┳━━━━━━━━┳━━━━━━━┓
┃ expert ┃ tokens ┃ share ┃
┡━━━━━━━━╇━━━━━━━━╇━━━━━━━┩
│ 0      │ 61     │ 0.7%  │
│ 1      │ 7704   │ 94.0% │
│ 2      │ 88     │ 1.1%  │
│ 3      │ 40     │ 0.5%  │
│ 4      │ 102    │ 1.2%  │
│ 5      │ 73     │ 0.9%  │
│ 6      │ 55     │ 0.7%  │
│ 7      │ 69     │ 0.8%  │
└────────┴────────┴───────┘
"""


@pytest.mark.parametrize("text", [
    "[rank3]: layer 5 tokens_per_expert: tensor([ 17, 3902,   40,   61,    0,   36,    9,   59], device='cuda:3')\n",
    COLLAPSED_TABLE,
    "selected_experts[:10] = tensor([[6, 1], [6, 3], [6, 0], [6, 1], [2, 6], [6, 5], [6, 1], [6, 4], [6, 7], [6, 1]])\n",
    "exp_counts: [1012 0 0 3 0 0 0 9]\n",
    "Expert load (layer 7):\n  expert 1: 3901 tokens (95.2%)\n  expert 2: 60 tokens (1.5%)\n"
    "  expert 3: 70 tokens (1.7%)\n  expert 4: 66 tokens (1.6%)\n",
    "[2026-12-02 09:14:55] expert usage (%): 88.0 3.1 2.2 1.9 1.6 1.2 1.1 0.9\n",
    "[rank0] topk_idx:\n[rank0] tensor([[5, 1], [5, 3], [5, 0], [5, 2], [5, 1], [4, 5], [5, 7], [5, 6], [5, 1]])\n",
], ids=["tokens-per-expert", "rich-table", "top-k-ids", "exp-counts-dead-experts", "per-expert-lines",
        "usage-percent-same-line", "top-k-ids-next-line"])
def test_router_collapse_is_read_from_printed_loads(text):
    d = top(text)
    assert d.entry_id == "router-collapse" and d.finding.startswith("This printout shows it")
    assert d.snippet and d.snippet in text


def test_a_balanced_printout_is_not_router_collapse():
    balanced = "tokens_per_expert: tensor([1046,  998, 1012, 1071,  987, 1003, 1025,  950])\n"
    assert [m.entry.id for m in knowledge.match(balanced)] == ["router-collapse"]  # a candidate...
    assert explain.explain_text(balanced) == []  # ...that the numbers clear


def test_a_code_fix_with_braces_is_shown():
    """moe-param-groups' fix quotes a Python dict: its braces are no placeholders to fill."""
    text = (Path(__file__).parent / "fixtures" / "tracebacks" / "real_moe_param_groups.txt").read_text()
    d = top(text)
    assert d.entry_id == "moe-param-groups" and "split-moe-groups" in d.fix_ids
    assert "{'params': list(model.parameters())" in d.fix[d.fix_ids.index("split-moe-groups")]


def test_a_variable_set_to_another_value_is_said_not_dropped():
    text = ("$ export CUDA_HOME=/usr/local/cuda-11.8\n$ python train.py\n"
            "deepspeed.ops.op_builder.builder.MissingCUDAException: CUDA_HOME does not exist, unable to compile CUDA op(s)\n")
    d = top(text)
    assert d.entry_id == "cuda-home-missing" and "set-cuda-home" in d.fix_ids
    assert "Line 1 sets CUDA_HOME=/usr/local/cuda-11.8." in d.finding


BENIGN = Path(__file__).parent / "fixtures" / "benign"


@pytest.mark.parametrize("name, candidate", [
    ("typical_fp16_start.log", "fp16-moe"),
    ("typical_fp16_long_run.log", "fp16-moe"),
    ("typical_moe_balanced_load.log", "router-collapse"),
])
def test_healthy_logs_hold_candidates_that_the_counts_clear(name, candidate):
    """The benign corpus really exercises the judges: the patterns find candidates, the numbers clear them."""
    text = (BENIGN / name).read_text()
    assert candidate in {m.entry.id for m in knowledge.match(text)}
    assert explain.explain_text(text) == []


@pytest.mark.parametrize("name", ["typical_jit_build_finishes.log", "typical_jit_cached_op_loads.log"])
def test_healthy_jit_logs_end_within_reach_of_the_stale_lock_pattern(name):
    """The extensions-root line is among the last lines, so only the progress after it clears it."""
    tail = (BENIGN / name).read_text().splitlines()[-8:]
    assert any("as PyTorch extensions root..." in line for line in tail)
    assert explain.explain_text("\n".join(tail) + "\n") == []
    root_only = [line for line in tail if "as PyTorch extensions root..." in line]
    assert top("\n".join(root_only) + "\n").entry_id == "stale-extension-lock"


def test_the_strategys_own_fp16_warning_needs_no_counting():
    """Our own message names its entry; the overflow counting is for logs, not for it."""
    own = "UserWarning: [fp16-moe] precision='16-mixed' (fp16) with MoE: router softmax and the aux loss overflow\n"
    assert top(own).entry_id == "fp16-moe"


@pytest.mark.parametrize("line, value", [
    ("$ export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n", "expandable_segments:True"),
    ("+ PYTORCH_ALLOC_CONF=expandable_segments:True torchrun --nproc-per-node 8 train.py\n", "expandable_segments:True"),
    ("os.environ[\"PYTORCH_ALLOC_CONF\"] = \"expandable_segments:True\"\n", "expandable_segments:True"),
    ("{'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True,max_split_size_mb:128'}\n",
     "expandable_segments:True,max_split_size_mb:128"),
    ("If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n", None),
    ("- PYTORCH_CUDA_ALLOC_CONF: (not set)\n", None),
    ("$ export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n$ unset PYTORCH_CUDA_ALLOC_CONF\n", None),
])
def test_environment_lines_are_read_only_where_something_is_set(line, value):
    """A hint inside a message or a report's "(not set)" sets nothing; the last setting wins."""
    from troubleshooter import log_facts

    found = log_facts.env_setting(line, "PYTORCH_ALLOC_CONF")  # torch 2.13 reads both names
    assert (found.value if found else None) == value
    if value:
        assert log_facts.same_value("expandable_segments:True", found.value)
