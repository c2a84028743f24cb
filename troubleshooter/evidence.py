"""What a report contains, as typed facts: the evidence ``explain`` decides on.

Why facts and not one pattern per entry: the same problem is pasted in many wordings, and a
pattern written against one of them misses the others, or, written broadly, claims reports it
does not explain. A fact is one thing the report shows, of one kind, stated as a short text that
an entry's evidence terms (``kind:regex`` in its TOML ``[evidence]`` table, see
:mod:`troubleshooter.decide`) are matched against:

* ``error``: an exception line, ``Type: message`` (``type``: its class name alone);
* ``frame``: a traceback frame, ``path/to/file.py::function``;
* ``library``: a library's own log line, ``deepspeed INFO <text>``, ``nccl WARN <text>``,
  ``torch W <text>``;
* ``config``: a configuration key and its value, ``key=value`` (JSON, YAML, DeepSpeed's
  config printout);
* ``stack``: what ran: ``deepspeed``, ``zero-1``/``zero-2``/``zero-3``, ``lightning``,
  ``transformers``, ``torchrun``, ``nccl``, ``gloo``, ``fp16``, ``bf16``, ``offload``, ``moe``,
  ``windows`` (the platform, not under WSL), ``plain-torch`` (a whole call stack from the
  script's entry that never enters DeepSpeed, Accelerate, Transformers, PEFT, TRL or Lightning,
  in a report that names none of them);
* ``phase``: where it failed: ``backward``, ``forward``, ``optimizer-step``, ``initialize``,
  ``checkpoint-save``, ``checkpoint-load``, ``build``;
* ``number``: numbers with a meaning: ``shape-zero`` (a size-0 tensor in an error message),
  ``params-size-zero`` (a printout listing parameters with 0 elements),
  ``oom requested=... free=...``, ``timeout-ms=600000``, ``uneven-batches`` (ranks that count
  different numbers of batches: ``Rank = 2, Number of batches 8`` beside ``Rank = 0, ... 4``);
* ``trend``: patterns over time: ``loss-scale-collapse`` (:mod:`troubleshooter.loss_scale`),
  ``expert-collapse`` (:mod:`troubleshooter.expert_load`), ``throughput-decay``,
  ``stopped-same-line`` (every rank's output ends on the same line, with no error);
* ``signal``: a process ended by a signal, ``SIGKILL (exit -9): <as printed>``, however it is told:
  torch elastic's ``exitcode  : -9`` and ``Signal 7 (SIGBUS) received by PID``, DeepSpeed's launcher
  ``exits with return code = -9``, a shell's 128+N status (``exit code 137``), UCX's ``Caught signal 7
  (Bus error``, or the reporter's words (``I return -9 directly``, ``exited -9``, ``bus error``, ``got
  killed``, ``被kill``);
* ``told``: a problem stated in words, in English or Chinese, with no library line for it:
  ``host-memory-exhausted`` ("no enough CPU memory", "makes host out of memory", ``内存不足``, Ray's memory
  monitor: "the node running low on memory"),
  ``resume-on-another-shape`` ("resume training even if the number of GPUs changes", ``换卡数后续训``),
  ``gpu-memory-exhausted`` (``显存不足``, "CUDA OOM"), ``nccl-timeout`` ("NCCL timeout", ``NCCL超时``),
  ``disk-full`` ("the disk is full", ``磁盘空间不足``), ``extensions-root-stall`` (the run "stops at" or
  "freezes" at torch's ``Using ... as PyTorch extensions root...`` line, however the line is retyped),
  ``checkpoint-save-hang`` ("``save_state()`` will hang", "stuck while saving the checkpoint"),
  ``extension-lock`` (torch's extension folder, or an extension's load, said to be locked or to hang),
  ``moe-zero3-hang`` (an MoE model said to hang under ZeRO-3, or to need its block as a leaf module),
  ``unused-expert-hang`` (a hang said to come when some experts get no tokens), ``locked-memory-low``
  ("a very small maximum locked memory limit", "soft memlock ... set to 64K"), ``remainder-batch-hang`` (a
  hang said to come with the last, incomplete batch kept: ``skip_remainder_batch=False``, ``drop_last=False``),
  ``compiler-missing`` ("my server does not have gcc"), ``p2p-ib-disabled-workaround`` (``NCCL_P2P_DISABLE=1`` or
  ``NCCL_IB_DISABLE=1`` said to make the run work, or slow).
  A problem told in two parts a sentence or two apart ("resume training on 16 GPUs" ... "complains about
  different DP size") is read by :class:`_Near`: each part by its own pattern, within a window;
* ``cut``: the innermost frame of a traceback the paste cut before its error line
  (``deepspeed/runtime/config.py::_configure_train_batch_size``): the function that was raising;
* ``code``: the source line Python printed under the innermost frame of the last traceback (what
  raised: ``param.shape[1]``).

``number`` also holds host-memory readings: DeepSpeed's ``see_memory_usage`` prints ``CPU Virtual
Memory:  used = 29.71 GB, percent = 95.3%`` (``runtime/utils.py``); at HOST_MEMORY_HIGH percent or
more it is ``host-memory-high``, and ``host-memory-high-at-end`` when the report ends within
END_LINES lines of that reading (the run was killed at its peak).

:func:`collect` reads them from a :class:`~troubleshooter.normalize.Normalized` report (the
trends from the input as it is: their readers strip prefixes themselves); :func:`summary` says
what was recognised when no known problem fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from troubleshooter import expert_load, loss_scale
from troubleshooter.normalize import ERROR_LINE, Normalized
from troubleshooter.oom_numbers import parse_oom

__all__ = ["Evidence", "Fact", "collect", "helpful", "summary"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"\n]+)",? line (?P<line>\d+),? in (?P<func>[^\s\n]+)', re.M)
_DS_LINE = re.compile(r"^\s*(?:\[[^\]\n]*\]\s*)?\[(?P<level>INFO|WARNING|ERROR|DEBUG)\]\s*\[(?P<src>[\w.]+):\d+", re.M)
#: NCCL's own lines: ``host:pid:tid [dev] NCCL INFO ...``, and its warnings with their source place
#: (``host:pid:tid [0] include/shm.h:48 NCCL WARN Error while creating shared memory segment ...``).
_NCCL_LINE = re.compile(r"^\s*[\w.-]*:\d+:\d+ \[\d+\] (?:[\w./-]+:\d+ )?NCCL (?P<level>INFO|WARN|ERROR)"
                        r" (?P<text>[^\n]*)", re.M)
_TORCH_LINE = re.compile(r"^\s*\[?(?P<level>[WEI])\d{4} [\d:.]+ (?:\d+ )?(?P<text>[^\n]*)", re.M)
_CONFIG = re.compile(
    r"""["']?(?P<key>stage|zero_optimization_stage|offload_(?:param|optimizer)|overlap_comm|contiguous_gradients"""
    r"""|reduce_bucket_size|stage3_[a-z_]+|train_micro_batch_size_per_gpu|gradient_accumulation_steps"""
    r"""|train_batch_size|fp16|bf16|enabled|loss_scale|initial_scale_power|min_loss_scale|ep_size"""
    r"""|num_experts|moe_[a-z_]+|device|pin_memory|zero_stage|precision|strategy)["']?\s*[:=]\s*"""
    r"""(?P<value>"[^"\n]{0,60}"|'[^'\n]{0,60}'|[\w.+-]{1,40}|\{)""")
_STACK = (
    ("deepspeed", re.compile(r"\bdeepspeed\b|\bds_config|\[deepspeed\]", re.I)),
    ("zero-3", re.compile(r"zero[_ -]?(?:stage[_ -]?)?3(?!\d)|stage3\b|\"stage\"\s*:\s*3(?!\d)|zero\.Init\b"
                          r"|partition_parameters\.py|ds_(?:numel|tensor|status)\b|stage_?3\.py|zero3", re.I)),
    ("zero-2", re.compile(r"zero[_ -]?(?:stage[_ -]?)?2(?!\d)|\"stage\"\s*:\s*2(?!\d)|stage_1_and_2\.py|zero2", re.I)),
    ("zero-1", re.compile(r"zero[_ -]?(?:stage[_ -]?)?1(?!\d)|\"stage\"\s*:\s*1(?!\d)", re.I)),
    ("lightning", re.compile(r"\blightning\b|pytorch_lightning", re.I)),
    ("transformers", re.compile(r"\btransformers[/\\.]|\bTrainer\b|from_pretrained", re.I)),
    ("accelerate", re.compile(r"\baccelerate\b", re.I)),
    ("torchrun", re.compile(r"\btorchrun\b|torch\.distributed\.(?:run|launch|elastic)", re.I)),
    ("nccl", re.compile(r"\bNCCL\b")),
    ("gloo", re.compile(r"\bgloo\b", re.I)),
    ("fp16", re.compile(r"\bfp16\b|float16|loss scale", re.I)),
    ("bf16", re.compile(r"\bbf16\b|bfloat16", re.I)),
    ("offload", re.compile(r"offload_(?:param|optimizer)|\boffload", re.I)),
    ("moe", re.compile(r"\bMoE\b|mixture.of.experts|\bexperts?\b|ep_size|moe", re.I)),
    # the platform, where it tells which fixes apply (torch's Windows builds have no NCCL at all):
    # a Windows version, "on Windows", a wheel tag, a drive path; not WSL (a Linux build)
    ("windows", re.compile(r"(?<![\w-])windows ?(?:1[01]|7|8(?:\.1)?|server|os)(?![\w.])"
                           r"|\b(?:on|under|in|for|with) windows\b|windows(?=[\u3040-\u30ff\u4e00-\u9fff])"
                           r"|\bwin(?:10|11|32|_amd64)\b|\b[A-Z]:\\(?:Users|Program Files|ProgramData|Windows)\\"
                           r"|\b[A-Z]:/(?:Users|Program Files|ProgramData|Windows)/", re.I)),
)
#: Stack facts that say the model ran under a library that partitions or wraps it (or a launcher).
_WRAPPERS = frozenset({"deepspeed", "zero-1", "zero-2", "zero-3", "lightning", "transformers", "accelerate",
                       "torchrun"})
_WRAPPER_FRAME = re.compile(r"(?:^|[/\\])(?:deepspeed|accelerate|transformers|peft|trl|lightning|pytorch_lightning"
                            r"|megatron|lightning_zeromoe)[/\\]", re.I)
#: A Linux build running on Windows: the "windows" stack fact is not emitted.
_WSL = re.compile(r"\bWSL2?\b|subsystem for linux", re.I)
_PHASES = (
    ("backward", re.compile(r"::backward$|_engine_run_backward|run_backward|reduce_(?:ready_partitions|partition)"
                            r"|reduce_scatter|grad_fn", re.I | re.M)),
    ("optimizer-step", re.compile(r"::step$|_take_model_step|optimizer_step", re.I | re.M)),
    ("checkpoint-save", re.compile(r"save_checkpoint|_save_zero_checkpoint|torch\.save\b|save_model"
                                   r"|serialization\.py::_?save\b", re.I)),
    ("checkpoint-load", re.compile(r"load_checkpoint|load_state_dict|zero_to_fp32|ds_to_universal|from_pretrained",
                                   re.I)),
    ("initialize", re.compile(r"::initialize$|::__init__$|::_configure_|::setup$", re.I | re.M)),
    ("build", re.compile(r"ninja|JIT|op_builder|building extension|CUDA_HOME|nvcc", re.I)),
    ("forward", re.compile(r"::(?:forward|_forward|_call_impl|zero3_linear_wrap)$", re.I | re.M)),
)
#: An error message with a size-0 tensor (a ZeRO-3 placeholder's 1-D shape [0], or a view of it
#: such as [-1, 0]); a first dimension of 0 ([0, 4096]) is an empty batch, not this.
_SHAPE_ZERO = re.compile(
    r"Size\(\[0\]\)|\[0\]|\[-1, 0\]|\b(?:tensor [ab]|vec|existing size) \(0\)|of 0 elements"
    r"|numel(?:\(\))? (?:is |== )?0\b|input of size 0\b", re.I)
#: A printout line naming a parameter and a size of 0 (``layers.3.fc1.weight, 0``,
#: ``... torch.Size([0])``, ``numel: 0``): many of them are ZeRO-3's partitioned placeholders.
_PARAM_ZERO = re.compile(r"^\W*[\w.]+\.(?:weight|bias)\b\W{1,4}(?:(?:numel|shape|size)\W{0,3})?"
                         r"(?:0|torch\.Size\(\[0\]\)|\[0\]|\(0,?\))\s*$", re.M)
#: This many such lines make a listing, not an accident.
PARAM_ZERO_LINES = 5
#: A rank's own count of its batches (steps, samples, iterations), in either order on one line.
_RANK_COUNT = re.compile(
    r"\brank\W{0,4}(?P<rank>\d{1,4})\b[^\n]{0,24}?\b(?:number|num|no\.?|count|len|total)[ _]?(?:of[ _])?"
    r"(?:training[ _])?(?:batches|steps|samples|iterations|iters)\W{0,4}(?P<count>\d+)"
    r"|\brank\W{0,4}(?P<rank2>\d{1,4})\W{1,4}(?P<count2>\d+)\s+(?:training\s+)?(?:batches|steps|iterations)\b",
    re.I)
_TIMEOUT = re.compile(r"Timeout\(ms\)=(\d+)|timed? ?out (?:after|waiting) (\d+) ?ms"
                      r"|(\d+) milliseconds before timing out", re.I)
_RATE = re.compile(r"(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>it/s|s/it|samples/s(?:ec)?|tokens?/s(?:ec)?|tok/s|TFLOPS)\b"
                   r"|(?P<key>samples_per_second|tokens_per_sec(?:ond)?|throughput)\W{1,3}"
                   r"(?P<value2>\d+(?:\.\d+)?)", re.I)
#: A line of the loss-scale history (where a loss-scale trend is quoted from).
_SCALE_LINE = re.compile(r"OVERFLOW|overflow|\bskipped[=:]|loss scale|Minimum loss scale", re.I)
_RANK_PREFIX = re.compile(r"^\s*(?:\[rank(\d+)\]:|(\d{1,3}): )")
#: Stack and configuration facts are looked for in this many characters at the start of a report
#: (where config printouts are) and TAIL_CHARS at its end (where the error is): a 4 MiB log is
#: not searched whole by every fact's regex. Library lines are read from the tail only.
HEAD_CHARS = 16 * 1024
TAIL_CHARS = 128 * 1024
#: The stack (what ran) is looked for in HEAD_CHARS and this many characters at the end.
STACK_TAIL_CHARS = 64 * 1024
#: Exit statuses that mean a signal: -N from Python's subprocess and torch elastic, 128+N from a shell.
SIGNALS = {9: "SIGKILL", 7: "SIGBUS", 11: "SIGSEGV", 6: "SIGABRT", 15: "SIGTERM"}
#: How a process's end by a signal is printed or told (see the module docstring for the sources).
_EXIT_SIGNAL = re.compile(
    r"\b(?:exit ?code|exitcode|return ?code|returncode|exit status|error ?code)\s*[:=]?\s*(?P<neg>-\d{1,2})\b"
    r"|\b(?:return(?:s|ed)?|exit(?:s|ed)?|die[sd]?|crash(?:es|ed)?|terminated)"
    r"(?: (?:with|directly|immediately|by))?(?: (?:exit|return|error|run))?(?: code| status)?"
    r"\s*[:=]?\s*(?P<neg2>-\d{1,2})\b"
    r"|\b(?:exit|return)(?:ed)? ?(?:with )?(?:code|status)\s*[:=]?\s*(?P<shell>13[4-9]|14[0-3])\b"
    r"|\bSignal (?P<num>\d{1,2}) \(SIG[A-Z]+\)|\bCaught signal (?P<num2>\d{1,2}) \("
    r"|\b(?:killed|terminated|died) (?:with|by) signal:? (?P<num3>\d{1,2})\b"
    r"|\b(?:killed|terminated|died) (?:with|by) signal:? (?P<name>SIG[A-Z]+)\b"
    r"|(?P<bus>\bbus error\b)|(?P<segv>\bsegmentation fault\b)"
    r"|\b(?:got|gets?|was|were|been|is|are|being)\s+(?P<killed>killed)\b(?!\s+(?:by|with)\s+signal)"
    r"|(?P<killed_zh>被\s*kill(?:ed)?|被杀)", re.I)
#: DeepSpeed's see_memory_usage (runtime/utils.py): ``CPU Virtual Memory:  used = 29.71 GB, percent = 95.3%``.
_HOST_MEMORY = re.compile(r"CPU Virtual Memory:\s+used = (?P<used>[\d.]+) ?GB, percent = (?P<pct>[\d.]+)%")
#: A host-memory reading this high (percent) is the host near its end.
HOST_MEMORY_HIGH = 90.0
#: A report that ends within this many non-blank lines of a reading ends at it.
END_LINES = 12
#: Host (CPU) memory said to have run out, in words: "no enough CPU memory", "makes host out of memory",
#: "CPU RAM is exhausted", "内存不足" (内存 is host memory; GPU memory is 显存).
_HOST_MEMORY_TOLD = re.compile(
    r"\b(?:not|no|insufficient)\s+(?:enough\s+)?(?:cpu|host|system|main)[ -]?(?:memory|mem|ram)"
    r"|\b(?:overflow\w*|exhaust\w*|fill\w*(?: up)?)\s+(?:the\s+)?(?:host\s+|server'?s?\s+)?DRAM\b"
    r"|\bDRAM\b[^\n.]{0,30}?\b(?:overflow\w*|exhausted|runs? out|ran out|running out|(?:is|was|gets?|got) full)"
    r"|\b(?:not|no)\s+enough\s+RAM\b"
    r"|\bout of (?:cpu|host|system|main)[ -]?(?:memory|mem|ram)\b"
    r"|\bhost (?:runs? |ran |running |goes |went )?out of memory\b"
    r"|\b(?:cpu|host|system|main)[ -]?(?:memory|mem|ram)\b[^\n.]{0,40}?"
    r"\b(?:out of memory|OOM|runs? out|ran out|running out|exhausted|(?:is|was|gets?|got|becomes?|became) full)"
    r"|\bRAM\b[^\n.]{0,30}?\b(?:runs? out|ran out|running out|exhausted|(?:is|was|gets?|got) full)"
    r"|(?<![显享])内存(?:不足|不够|溢出|爆|满了|耗尽|占满|用完|撑爆)|(?:撑爆|耗尽|占满|爆)了?内存"
    # Ray's memory monitor, which kills a worker before the kernel does: "Task was killed due to the node
    # running low on memory", "... which exceeds the memory usage threshold of 0.95", its docs page's name
    r"|\bnode (?:is |was )?running low on memory\b|\bexceeds the memory usage threshold\b|\bray-oom-prevention\b",
    re.I)
#: Resuming (loading a checkpoint) on another number of GPUs, told in words: "load this checkpoint with a
#: different GPU count", "resume training even if the number of GPUs (world_size) changes", "换卡数后续训".
_RESUME_OTHER_SHAPE_TOLD = re.compile(
    r"(?:resum|restor|reload|continu|load)\w*\b[^.\n。]{0,100}?(?:\b(?:different|fewer|more|another|changed?"
    r"|changes|changing|smaller|larger|new)\s+(?:number\s+of\s+)?(?:GPUs?|gpu count|world[ _]size|nodes|ranks"
    r"|machines|cards|devices)\b|\bnumber of (?:GPUs|nodes|ranks|devices)\b[^.\n]{0,40}?\b(?:chang|differ|decreas"
    r"|increas|reduc))"
    r"|\b(?:world[ _]size|number of (?:GPUs|nodes|ranks|devices)|GPU count)\b[^.\n]{0,60}?\b(?:chang\w*|differs?"
    r"|different|decreas\w*|increas\w*|reduc\w*)\b[^.\n]{0,80}?\b(?:resum|restor|reload|load\w* (?:the |a |my )?"
    r"checkpoint)"
    r"|(?:换|改|变|不同的?|减少|增加)[^。\n]{0,8}(?:卡数|GPU数|显卡数|机器数|节点数|卡)[^。\n]{0,20}(?:续训|恢复|resume|加载)"
    r"|(?:续训|恢复训练|resume)[^。\n]{0,20}(?:换|改|变|不同的?|减少|增加)[^。\n]{0,8}(?:卡数|GPU数|显卡数|机器数|节点数)", re.I)
#: GPU memory said to have run out: "显存不足", "爆显存", "CUDA OOM", "not enough GPU memory".
_GPU_MEMORY_TOLD = re.compile(
    r"显存(?:不足|不够|溢出|爆|满了|耗尽|占满|用完|撑爆|OOM)|(?:爆|撑爆|耗尽|占满)了?显存|\b(?:CUDA|GPU|VRAM)[ -]?OOM\b"
    r"|\bOOM (?:on|in) (?:the |my )?GPUs?\b"
    r"|\b(?:GPU|VRAM|video) ?memory\b[^.\n]{0,40}?\b(?:ran out|runs? out|running out"
    r"|exhausted|not enough|insufficient|is full|was full)|\b(?:not|no) enough (?:GPU|VRAM|video) ?memory"
    r"|\bout of (?:GPU|VRAM|video) ?memory|(?<![A-Za-z])CUDA out of memory\b", re.I)
#: An NCCL collective said to have timed out, as an event (not a setting: "I set the NCCL timeout to 2 h"):
#: "hit an NCCL timeout", "NCCL timeout after 30 minutes", "NCCL超时"; not torch's own "Some NCCL operations have
#: failed or timed out", which ProcessGroupNCCL prints for any failed collective (a network error too).
_NCCL_TIMEOUT_TOLD = re.compile(
    r"\bNCCL\b[^.\n]{0,30}?(?<!failed or )\btimed out\b|\btimed out\b[^.\n]{0,20}\bNCCL\b"
    r"|(?:got|get|gets|getting|hit|hits|hitting|encounter\w*|run into|ran into|fails? with|failed with|then|and)"
    r"\W{1,3}(?:a |an |the )?NCCL[ _-]?time ?out\b(?![ _-]?(?:to|=|:|is|was|of|setting|value)\b)"
    r"|\bNCCL[ _-]?time ?out (?:error|exception|happen\w*|occur\w*|after)\b|NCCL\s*超时|超时[^。\n]{0,10}NCCL", re.I)
#: A disk said to be full: "the disk is full", "ran out of disk space", "磁盘空间不足".
_DISK_FULL_TOLD = re.compile(
    r"磁盘(?:空间)?(?:不足|满了|已满|不够|占满)|硬盘(?:空间)?(?:不足|满了|已满|不够)"
    r"|\b(?:disk|storage|filesystem|file system|partition)\b[^.\n]{0,30}?\b(?:is |was |got |gets |became |becomes )"
    r"(?:full|out of space)\b|\bno (?:more )?(?:disk )?space left\b"
    r"|\b(?:run|runs|running|ran) out of (?:disk|storage) ?space\b"
    r"|\bdisk quota\b|\bout of disk space\b", re.I)
#: A run said to stall (stop, hang, freeze, "no longer run") at torch's cpp_extension line ``Using <dir> as
#: PyTorch extensions root...`` (DeepSpeed prints it before it loads or builds an op; a lock a killed build
#: left there makes every later load wait forever), in either order, the line however it is retyped
#: (``torch_ extensions as pytorch extensions root``).
_STALL = (r"(?:\b(?:stops?|stopped|stuck|hangs?|hung|hanging|freez\w*|froze|frozen|halts?|halted)\b"
          r"|\bno longer (?:runs?|moves?|progress\w*|continues?)\b|\bnothing (?:happens|more)\b"
          r"|\bwaits? forever\b|卡住|卡在|卡死|不动)")
_EXTENSIONS_ROOT_STALL_TOLD = re.compile(
    r"extensions?\s*root\b[\s\S]{0,200}?" + _STALL + "|" + _STALL + r"[\s\S]{0,1200}?extensions?\s*root\b", re.I)
#: Saving a checkpoint said to hang: "``accelerator.save_state()`` will hang", "stuck when saving the model".
_SAVE = (r"(?:save_checkpoint|save_state|save_model|save_pretrained|saving (?:the |a |my )?(?:model|checkpoint|state)"
         r"|(?:the )?save stage|保存)")
_HANG = r"(?:\bhangs?\b|\bhung\b|\bhanging\b|\bstuck\b|\bfreez\w*|\bfroze\b|卡住|卡死|不动)"
#: A run said to hang, as one part of a problem told in two (:class:`_Near`).
_HANG_WORDS = re.compile(_HANG, re.I)
_SAVE_HANG_TOLD = re.compile(
    _SAVE + r"[^\n]{0,120}?" + _HANG + "|" + _HANG + r"[^\n]{0,60}?\b(?:when|while|during|at|in)\b[^\n]{0,40}?"
    + _SAVE, re.I)


@dataclass(frozen=True)
class _Near:
    """Two things said close together, in either order: a problem told in a sentence or two of one's own
    words ("resume training on 16 GPUs" ... "complains about different DP size"), where one phrase for the
    whole of it would miss every other wording. ``window`` is how many characters may lie between them."""

    first: re.Pattern[str]
    second: re.Pattern[str]
    window: int

    def last(self, text: str, base: int) -> tuple[int, str] | None:
        """Where the last such pair starts, and the text from its start to its end."""
        found = None
        for a in self.first.finditer(text, base):
            lo, hi = max(base, a.start() - self.window), a.end() + self.window
            for b in self.second.finditer(text, lo, hi):
                start, end = min(a.start(), b.start()), max(a.end(), b.end())
                found = (start, text[start:end])
        return found


_RESUMING = re.compile(r"\bresum\w*|\bcontinu\w* (?:the )?training\b|续训|恢复训练", re.I)
#: A number of GPUs (or a data-parallel size) said to differ: "different DP size", "with a different GPU count",
#: "fewer nodes", "the world size changed", "换卡数".
_OTHER_SHAPE = re.compile(
    r"\b(?:different|fewer|more|another|changed?|changes|changing|smaller|larger|less|new)\s+(?:number\s+of\s+)?"
    r"(?:GPUs?|gpu count|world[ _]size|nodes|ranks|machines|cards|devices|DP(?: world)? size"
    r"|data[- ]parallel(?: world)? size)\b"
    r"|\b(?:DP(?: world)? size|data[- ]parallel(?: world)? size|world[ _]size)\b[^.\n]{0,30}?\b(?:differ\w*|chang\w*)"
    r"|(?:换|改|变|不同的?|减少|增加)[^。\n]{0,8}(?:卡数|GPU数|显卡数|机器数|节点数)", re.I)
#: Resuming said to happen on another shape, the two said a sentence or two apart.
_RESUME_OTHER_SHAPE_NEAR = _Near(_RESUMING, _OTHER_SHAPE, 200)
#: torch's JIT extension folder, or an extension's load or build, said to be locked or to hang: "the
#: /tmp/torch_extensions directory will be locked", "delete the torch extension folder on a hang".
_EXTENSION = re.compile(r"torch[_ ]extensions?\b|\bextensions? (?:folder|dir\w*|cache)\b|\bcpp_extension\b"
                        r"|\bextension(?:s)? (?:load|build|compil)\w*", re.I)
_EXTENSION_LOCK_NEAR = _Near(_EXTENSION, re.compile(r"\block(?:ed|s|file)?\b|" + _HANG, re.I), 80)
#: An MoE model under ZeRO-3 said to hang or to need its MoE block as a leaf module: "hangs during reduce_scatter
#: calls when an expert is unused on one rank", "Qwen MoE models under ZeRO-3 may hang", "set_z3_leaf_modules".
_MOE_WORD = re.compile(r"(?<![a-z])mo[eE](?![a-z])|\bMOE\b|mixture[- ]of[- ]experts|\bexperts?\b", re.I)
_ZERO3_HANG = re.compile(
    r"(?:zero[-_ ]?(?:stage[-_ ]?)?3|\bz3\b|\bstage[-_ ]?3\b)[^\n]{0,200}?(?:" + _HANG
    + r"|reduce_scatter|incorrect collective|wrong collective)"
    r"|" + _HANG + r"[^\n]{0,200}?(?:zero[-_ ]?(?:stage[-_ ]?)?3|\bz3\b|\bstage[-_ ]?3\b)"
    r"|\bset_z3_leaf_modules\b|\bz3[-_ ]leaf\b|\bleaf[-_ ]modules?\b", re.I)
_MOE_ZERO3_HANG_NEAR = _Near(_MOE_WORD, _ZERO3_HANG, 200)
#: Some experts said to get no tokens ("when some experts in MoE layers are not activated", "unused experts",
#: "an expert receives no tokens"): with a hang a sentence away, the ranks ran different experts' gathers.
_EXPERTS_UNUSED = re.compile(
    r"\bexperts?\b[^.\n]{0,40}?\b(?:(?:are|is|were|was|get|gets|got)\s+)?(?:not|never)\s+"
    r"(?:activated|used|selected|routed(?: to)?|chosen|hit|visited|called)\b"
    r"|\b(?:un(?:used|activated|selected|routed|visited)|inactive|idle)\s+experts?\b"
    r"|\bexperts?\b[^.\n]{0,30}?\b(?:receives?|gets?|got|received)\s+(?:no|zero|0)\s+tokens\b", re.I)
_UNUSED_EXPERT_HANG_NEAR = _Near(_EXPERTS_UNUSED, _HANG_WORDS, 200)
#: The locked-memory limit said to be low: "a very small maximum locked memory limit", "the soft memlock setting
#: is being set to 64K" (not a limits.conf or ``ulimit -a`` printout, which says what it is, not that it is low).
_MEMLOCK_LOW_TOLD = re.compile(
    r"\b(?:small|low|tiny|limited|insufficient)\s+(?:max(?:imum)?\s+)?(?:locked[- ]memory|memlock)\b"
    r"|\b(?:locked[- ]memory|memlock)\b(?: limit| setting| size)?\s+(?:is |was )?(?:too|very) (?:small|low)\b"
    r"|\b(?:locked[- ]memory|memlock)\b[^.\n]{0,40}?\b(?:set|limited|capped|lowered|reduced|restricted) (?:to|at) "
    r"\d+\s*(?:[kKmM](?:i?B|bytes)?)?\b(?! *(?:GB|G\b|unlimited))", re.I)
#: A hang said to come with the last, incomplete batch kept (fairseq's skip_remainder_batch=False, a DataLoader's
#: drop_last=False): the ranks then count different numbers of batches.
_REMAINDER_BATCH = re.compile(
    r"\b(?:skip_remainder_batch|drop_last)\s*(?:=|:|is|set to)\s*False\b"
    r"|\b(?:the )?(?:last|final|remainder|remaining) (?:incomplete |partial |smaller )?batch(?:es)? (?:is |are )?"
    r"(?:kept|not (?:dropped|skipped))\b", re.I)
_REMAINDER_BATCH_HANG_NEAR = _Near(_REMAINDER_BATCH, _HANG_WORDS, 200)
#: The C/C++ compiler said to be missing: "my server does not have gcc", "g++ is not installed", "没有安装gcc".
_COMPILER_MISSING_TOLD = re.compile(
    r"\b(?:does not|doesn'?t|did not|didn'?t|do not|don'?t) have (?:a |any )?(?:gcc|g\+\+|c\+\+ compiler|compiler)\b"
    r"|\b(?:gcc|g\+\+|c\+\+ compiler)\b (?:is |was )?(?:not|never) (?:installed|found|available)\b"
    r"|\bno (?:gcc|g\+\+|c\+\+ compiler)\b (?:is )?"
    r"(?:installed|found|available|on (?:the|my|this) (?:server|machine|system))\b"
    r"|(?:没有|未)(?:安装)?\s*(?:gcc|g\+\+|c\+\+编译器|编译器)", re.I)
#: NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1 said to make a run work, or to make it slow: "the model works by setting
#: the variable NCCL_P2P_DISABLE =1", "before the fix, running with NCCL_P2P_DISABLE=1" (a setting in a command
#: line or an env printout says only that it is set).
_P2P_IB_DISABLED = re.compile(r"\bNCCL_(?:P2P|IB)_DISABLE\b\s*(?:=|is set to|set to)\s*[\"'`]?1\b", re.I)
_WORKS_OR_SLOW = re.compile(r"\b(?:works?|worked|fix(?:es|ed)?|solv(?:es|ed)|resolv(?:es|ed)|slow(?:er|s|ed|ly|down)?"
                            r"|speed|throughput|bandwidth)\b", re.I)
_P2P_IB_WORKAROUND_NEAR = _Near(_P2P_IB_DISABLED, _WORKS_OR_SLOW, 60)
#: What ``told`` facts say, and how each is told.
_TOLD = (("host-memory-exhausted", _HOST_MEMORY_TOLD), ("resume-on-another-shape", _RESUME_OTHER_SHAPE_TOLD),
         ("gpu-memory-exhausted", _GPU_MEMORY_TOLD), ("nccl-timeout", _NCCL_TIMEOUT_TOLD),
         ("disk-full", _DISK_FULL_TOLD), ("extensions-root-stall", _EXTENSIONS_ROOT_STALL_TOLD),
         ("checkpoint-save-hang", _SAVE_HANG_TOLD), ("resume-on-another-shape", _RESUME_OTHER_SHAPE_NEAR),
         ("extension-lock", _EXTENSION_LOCK_NEAR), ("moe-zero3-hang", _MOE_ZERO3_HANG_NEAR),
         ("unused-expert-hang", _UNUSED_EXPERT_HANG_NEAR), ("locked-memory-low", _MEMLOCK_LOW_TOLD),
         ("remainder-batch-hang", _REMAINDER_BATCH_HANG_NEAR), ("compiler-missing", _COMPILER_MISSING_TOLD),
         ("p2p-ib-disabled-workaround", _P2P_IB_WORKAROUND_NEAR))
#: A frame's source line, as Python prints it under the frame (not the ``~~~^^^`` markers below it).
_CODE_MARKERS = re.compile(r"^[\s~^]*$")
#: A throughput series must have this many points, and end below this share of its early best.
TREND_POINTS = 6
DECAY_SHARE = 0.5


@dataclass(frozen=True)
class Fact:
    """One thing the report shows. ``value`` is what evidence terms match; ``line_no`` is the
    input's line (1-based, 0 when the fact is the whole report's)."""

    kind: str
    value: str
    line_no: int
    offset: int = 0  # in the normalised text

    def describe(self) -> str:
        """``kind value (line N)``, as ``explain --why`` prints it."""
        where = f" (line {self.line_no})" if self.line_no else ""
        value = self.value if len(self.value) <= 160 else self.value[:159] + "…"
        return f"{self.kind} {value}{where}"


@dataclass(frozen=True)
class Evidence:
    """Every fact of a report, in order of kind, then of appearance."""

    facts: tuple[Fact, ...]

    def of(self, kind: str) -> tuple[Fact, ...]:
        """The facts of one kind."""
        return tuple(f for f in self.facts if f.kind == kind)

    def find(self, kind: str, pattern: re.Pattern[str]) -> Fact | None:
        """The last fact of ``kind`` whose value ``pattern`` finds (the end of a log matters)."""
        found = None
        for f in self.facts:
            if f.kind == kind and pattern.search(f.value):
                found = f
        return found

    def has(self, kind: str, value: str) -> bool:
        """Whether there is a fact of ``kind`` with exactly this value."""
        return any(f.kind == kind and f.value == value for f in self.facts)


def _errors(norm: Normalized) -> list[Fact]:
    out = []
    offset = 0
    for i, line in enumerate(norm.text.split("\n"), 1):
        hit = ERROR_LINE.match(line.strip()) if ("Error" in line or "Exception" in line
                                                  or "Interrupt" in line or "Failure" in line) else None
        if hit:
            message = (hit.group("message") or "").strip()
            value = hit.group("type") + (f": {message}" if message else "")
            out.append(Fact("error", value, norm.input_line(i), offset))
            out.append(Fact("type", hit.group("type").rsplit(".", 1)[-1], norm.input_line(i), offset))
        offset += len(line) + 1
    return out


def _frames(norm: Normalized) -> list[Fact]:
    return [Fact("frame", f"{m.group('file').replace(chr(92), '/')}::{m.group('func')}",
                 norm.line_of_offset(m.start()), m.start()) for m in _FRAME.finditer(norm.text)]


def _library_lines(norm: Normalized) -> list[Fact]:
    text = norm.text
    start = max(0, len(text) - TAIL_CHARS)
    out = [Fact("library", f"deepspeed {m.group('level')} {text[m.start():text.find(chr(10), m.start())].strip()}",
                norm.line_of_offset(m.start()), m.start()) for m in _DS_LINE.finditer(text, start)]
    if "NCCL" in text:
        out += [Fact("library", f"nccl {m.group('level')} {m.group('text').strip()}", norm.line_of_offset(m.start()),
                     m.start()) for m in _NCCL_LINE.finditer(text, start)]
    out += [Fact("library", f"torch {m.group('level')} {m.group('text').strip()}", norm.line_of_offset(m.start()),
                 m.start()) for m in _TORCH_LINE.finditer(text, start)]
    return out


def _config(norm: Normalized) -> list[Fact]:
    seen: dict[str, Fact] = {}
    text = norm.text
    hits = [*_CONFIG.finditer(text, 0, min(len(text), HEAD_CHARS))]
    if len(text) > HEAD_CHARS:
        hits += _CONFIG.finditer(text, max(HEAD_CHARS, len(text) - TAIL_CHARS))
    for m in hits:
        value = m.group("value").strip("\"'")
        seen[f"{m.group('key')}={value}"] = Fact("config", f"{m.group('key')}={value}",
                                                  norm.line_of_offset(m.start()), m.start())
    return list(seen.values())


def _first(pattern: re.Pattern[str], norm: Normalized) -> int | None:
    """The first hit in the head or the tail of the report (a huge log is not read whole)."""
    text = norm.text
    hit = pattern.search(text, 0, min(len(text), HEAD_CHARS))
    if hit is None and len(text) > HEAD_CHARS:
        hit = pattern.search(text, max(HEAD_CHARS, len(text) - STACK_TAIL_CHARS))
    return None if hit is None else hit.start()


def _plain_torch(names: set[str], frames: list[Fact], errors: list[Fact]) -> Fact | None:
    """The ``plain-torch`` fact: the report holds a whole call stack, from the script's entry
    (a ``<module>`` frame) to the error (an error line after that frame: a paste cut inside the stack
    is not whole), none of whose frames is in a library that partitions or
    wraps the model (DeepSpeed, Accelerate, Transformers, PEFT, TRL, Lightning, Megatron), and the
    report never names one of them or a launcher: what failed ran outside any of them."""
    entry = next((f for f in frames if f.value.endswith("::<module>")), None)
    if entry is None or names & _WRAPPERS or any(_WRAPPER_FRAME.search(f.value) for f in frames):
        return None
    if not any(e.offset > entry.offset for e in errors):  # cut before its error: the stack is not whole
        return None
    return Fact("stack", "plain-torch", entry.line_no, entry.offset)


def _stack_and_phase(norm: Normalized, frames: list[Fact], errors: list[Fact]) -> list[Fact]:
    out = []
    for name, pattern in _STACK:
        at = _first(pattern, norm)
        if name == "windows" and at is not None and _first(_WSL, norm) is not None:
            continue
        if at is not None:
            out.append(Fact("stack", name, norm.line_of_offset(at), at))
    plain = _plain_torch({f.value for f in out}, frames, errors)
    if plain is not None:
        out.append(plain)
    # the phase: the innermost frame of the last traceback that tells one (frames outward)
    last_error = errors[-1].offset if errors else len(norm.text)
    near = [f for f in frames if f.offset < last_error][-12:]
    for frame in reversed(near):
        name = next((n for n, pattern in _PHASES if pattern.search(frame.value)), None)
        if name is not None:
            out.append(Fact("phase", name, frame.line_no, frame.offset))
            break
    return out


def _numbers(norm: Normalized, errors: list[Fact]) -> list[Fact]:
    out = []
    for e in errors:
        if e.kind == "error" and re.search(r"shape|size|dimension|broadcast|numel|view|reshape", e.value, re.I) \
                and _SHAPE_ZERO.search(e.value):
            out.append(Fact("number", "shape-zero", e.line_no, e.offset))
    listing = list(_PARAM_ZERO.finditer(norm.text[-TAIL_CHARS:]))
    if len(listing) >= PARAM_ZERO_LINES:
        base = max(0, len(norm.text) - TAIL_CHARS)
        out.append(Fact("number", f"params-size-zero: {len(listing)} parameters listed with 0 elements",
                        norm.line_of_offset(base + listing[0].start()), base + listing[0].start()))
    base = max(0, len(norm.text) - TAIL_CHARS)
    tail = norm.text[base:]
    oom = parse_oom(tail) if "memory" in tail else None
    if oom is not None:
        out.append(Fact("number", f"oom {oom.summary()}", 0))
    hit = _TIMEOUT.search(tail) if "out" in tail else None
    if hit:
        ms = next(g for g in hit.groups() if g)
        out.append(Fact("number", f"timeout-ms={ms}", norm.line_of_offset(base + hit.start()), base + hit.start()))
    uneven = _uneven_batches(tail) if re.search(r"rank", tail, re.I) else None
    if uneven is not None:
        text, at = uneven
        out.append(Fact("number", text, norm.line_of_offset(base + at), base + at))
    return out


def _signal_of(m: re.Match[str]) -> str | None:
    """The signal's name an exit status or a signal line means (None: not a signal)."""
    if m.group("bus"):
        return "SIGBUS"
    if m.group("segv"):
        return "SIGSEGV"
    if m.group("killed") or m.group("killed_zh"):  # "the process got killed": told, with no number
        return "SIGKILL"
    if m.group("name"):
        return m.group("name").upper()
    raw = m.group("neg") or m.group("neg2")
    if raw is not None:
        return SIGNALS.get(-int(raw))
    if m.group("shell"):
        return SIGNALS.get(int(m.group("shell")) - 128)
    number = m.group("num") or m.group("num2") or m.group("num3")
    return SIGNALS.get(int(number)) if number else None


def _signals(norm: Normalized) -> list[Fact]:
    """Every process end by a signal the report shows or tells (one fact per signal, its last)."""
    base = max(0, len(norm.text) - TAIL_CHARS)
    found: dict[str, Fact] = {}
    for m in _EXIT_SIGNAL.finditer(norm.text, base):
        name = _signal_of(m)
        if name is None:
            continue
        code = next((f"exit {v}" for v in (m.group("neg"), m.group("neg2"), m.group("shell")) if v), "")
        value = f"{name}{f' ({code})' if code else ''}: {m.group().strip()}"
        found.pop(name, None)
        found[name] = Fact("signal", value, norm.line_of_offset(m.start()), m.start())
    return list(found.values())


def _host_memory(norm: Normalized) -> list[Fact]:
    """DeepSpeed's host-memory readings: the highest, and whether it is high, and at the end."""
    base = max(0, len(norm.text) - TAIL_CHARS)
    readings = [m for m in _HOST_MEMORY.finditer(norm.text, base)] if "CPU Virtual Memory" in norm.text else []
    if not readings:
        return []
    top = max(readings, key=lambda m: float(m.group("pct")))
    pct = float(top.group("pct"))
    words = f"CPU virtual memory at {pct:g}% ({top.group('used')} GB used)"
    line_no = norm.line_of_offset(top.start())
    out = [Fact("number", f"host-memory: {words}", line_no, top.start())]
    if pct >= HOST_MEMORY_HIGH:
        after = sum(1 for line in norm.text[top.end():].split("\n") if line.strip())
        kind = "host-memory-high-at-end" if after <= END_LINES else "host-memory-high"
        out.append(Fact("number", f"{kind}: {words}", line_no, top.start()))
    return out


def _told(norm: Normalized) -> list[Fact]:
    """Problems stated in words (a report with no library line for them)."""
    base = max(0, len(norm.text) - TAIL_CHARS)
    out = []
    seen = set()
    for name, pattern in _TOLD:
        if name in seen:
            continue
        found = pattern.last(norm.text, base) if isinstance(pattern, _Near) else _last_match(pattern, norm.text, base)
        if found is not None:
            seen.add(name)
            start, said = found
            out.append(Fact("told", f"{name}: {said[:160]}", norm.line_of_offset(start), start))
    return out


def _last_match(pattern: re.Pattern[str], text: str, base: int) -> tuple[int, str] | None:
    last = None
    for last in pattern.finditer(text, base):
        pass
    return None if last is None else (last.start(), last.group())


def _cut_and_code(norm: Normalized, frames: list[Fact], errors: list[Fact]) -> list[Fact]:
    """``cut``: the innermost frame when the paste stops after it, before any error line; ``code``:
    the source line under the innermost frame before the last error line."""
    out = []
    last_error = max((e.offset for e in errors), default=-1)
    if frames and frames[-1].offset > last_error:
        out.append(Fact("cut", frames[-1].value, frames[-1].line_no, frames[-1].offset))
    before = [f for f in frames if f.offset < last_error]
    if before:
        frame = before[-1]
        end = norm.text.find("\n", frame.offset)
        for line in norm.text[end + 1:last_error].split("\n")[:4] if end != -1 else ():
            if line.strip() and not _CODE_MARKERS.match(line):
                if not _FRAME.match(line):
                    out.append(Fact("code", line.strip()[:200], frame.line_no + 1, frame.offset))
                break
    return out


def _uneven_batches(text: str) -> tuple[str, int] | None:
    """Per-rank batch (step, sample) counts that differ (``Rank = 2, Number of batches 8`` beside
    ``Rank = 0, Number of batches 4``; ``rank 1: 13 batches``): the ranks ran different numbers of
    steps. The fact's text and the offset of the first count, or None."""
    counts: dict[str, int] = {}
    first = -1
    for m in _RANK_COUNT.finditer(text):
        rank = m.group("rank") or m.group("rank2")
        count = int(m.group("count") or m.group("count2"))
        counts.setdefault(rank, count)
        first = m.start() if first < 0 else first
    if len(counts) < 2 or len(set(counts.values())) < 2:
        return None
    listed = ", ".join(f"rank {r}: {c}" for r, c in sorted(counts.items(), key=lambda rc: int(rc[0])))
    return f"uneven-batches: the ranks count different numbers of batches ({listed})", first


def _throughput_decay(text: str) -> str | None:
    """Throughput that falls step after step: the last value below DECAY_SHARE of the best of the
    first third, and most steps falling."""
    values: list[float] = []
    slower_is_larger = False
    for m in _RATE.finditer(text):
        raw = m.group("value") or m.group("value2")
        values.append(float(raw))
        slower_is_larger = slower_is_larger or (m.group("unit") or "").lower() == "s/it"
    if len(values) < TREND_POINTS:
        return None
    if slower_is_larger:
        values = [1.0 / v for v in values if v > 0]
    third = max(1, len(values) // 3)
    best, last = max(values[:third]), values[-1]
    falling = sum(1 for a, b in zip(values, values[1:]) if b < a)
    if best > 0 and last < DECAY_SHARE * best and falling >= 0.6 * (len(values) - 1):
        return f"throughput fell from {best:g} to {last:g} over {len(values)} readings"
    return None


def _stopped_same_line(text: str) -> str | None:
    """Every rank's output (two or more ranks) ends on the same line, and no rank printed an error."""
    last: dict[str, str] = {}
    for line in text.split("\n"):
        hit = _RANK_PREFIX.match(line)
        if hit and line[hit.end():].strip():
            last[hit.group(1) or hit.group(2)] = line[hit.end():].strip()
    if len(last) < 2 or len(set(last.values())) != 1:
        return None
    if any(ERROR_LINE.match(v) for v in last.values()):
        return None
    return f"all {len(last)} ranks stop after: {next(iter(last.values()))[:120]}"


def _trends(norm: Normalized) -> list[Fact]:
    """Trends in the report's last TAIL_CHARS (line numbers are those of the whole input)."""
    out = []
    base = max(0, len(norm.original) - TAIL_CHARS)
    tail = norm.original[base:]
    skipped = norm.original.count("\n", 0, base)
    lowered = tail.lower()
    reason = (loss_scale.collapse(loss_scale.history(tail))
              if "overflow" in lowered or "loss scale" in lowered or "skipped=" in lowered else None)
    if reason:
        last = None
        for last in _SCALE_LINE.finditer(tail):
            pass
        line_no = skipped + tail.count("\n", 0, last.start()) + 1 if last else 0
        out.append(Fact("trend", f"loss-scale-collapse: {reason}", line_no))
    expert = "expert" in lowered or "topk" in lowered or "top_k" in lowered or "router" in lowered
    found = expert_load.find_collapse(tail) if expert else None
    if found is not None:
        out.append(Fact("trend", f"expert-collapse: {found.summary}", skipped + tail.count("\n", 0, found.offset) + 1))
    rates = any(k in lowered for k in ("/s", "s/it", "throughput", "per_second", "per_sec", "tflops"))
    decay = _throughput_decay(tail) if rates else None
    if decay:
        out.append(Fact("trend", f"throughput-decay: {decay}", 0))
    stopped = _stopped_same_line(tail)
    if stopped:
        out.append(Fact("trend", f"stopped-same-line: {stopped}", 0))
    return out


def collect(norm: Normalized) -> Evidence:
    """Every fact the normalised report shows."""
    errors = _errors(norm)
    frames = _frames(norm)
    facts = [*errors, *frames, *_library_lines(norm), *_config(norm), *_stack_and_phase(norm, frames, errors),
             *_numbers(norm, errors), *_host_memory(norm), *_trends(norm), *_signals(norm), *_told(norm),
             *_cut_and_code(norm, frames, errors)]
    return Evidence(tuple(facts))


def _stack_words(ev: Evidence) -> str:
    names = [f.value for f in ev.of("stack")]
    zero = next((n for n in ("zero-3", "zero-2", "zero-1") if n in names), None)
    words = []
    if "deepspeed" in names or zero:
        words.append("DeepSpeed" + (f" ZeRO-{zero[-1]}" if zero else ""))
    words += [w for n, w in (("lightning", "Lightning"), ("transformers", "Transformers"),
                             ("accelerate", "Accelerate")) if n in names]
    return " + ".join(words)


#: What an error message is about, in a few words, for the summary (the first that fits).
_MESSAGE_KINDS = tuple((re.compile(p, re.I), words) for p, words in (
    (r"out of memory|OutOfMemory|can't allocate memory|bad_alloc", "out of memory"),
    (r"size mismatch|shape|must match the size|size of tensor|dimension|broadcast|numel", "a size mismatch"),
    (r"timed? ?out|timeout", "a timeout"),
    (r"No module named|cannot import name|ImportError|undefined symbol", "an import failure"),
    (r"Address already in use|Connection (?:refused|reset|closed)|Broken pipe", "a connection failure"),
    (r"expected all tensors to be on the same device|device", "a device mismatch"),
    (r"No such file or directory|FileNotFoundError|Permission denied", "a missing or unreadable file"),
))


def summary(ev: Evidence) -> str:
    """One sentence of what was recognised, for a report no known problem fits: "a DeepSpeed
    ZeRO-3 run failed in backward with RuntimeError (a size-0 tensor)"."""
    stack = _stack_words(ev)
    errors = [f for f in ev.of("error")]
    phase = next(iter(ev.of("phase")), None)
    trends = ev.of("trend")
    run = f"a {stack} run" if stack else "a run"
    if errors:
        last = errors[-1]
        kind = last.value.split(":", 1)[0].rsplit(".", 1)[-1]
        what = next((words for pattern, words in _MESSAGE_KINDS if pattern.search(last.value)), "")
        shape = ", with a size-0 tensor" if ev.has("number", "shape-zero") else ""
        about = f" ({what}{shape})" if what else (f" ({shape[2:]})" if shape else "")
        where = f" in {phase.value}" if phase else ""
        return f"{run} failed{where} with {kind}{about} (line {last.line_no})"
    if trends:
        return f"{run} shows {trends[-1].value.split(':', 1)[0]}, without an error line"
    signals = ev.of("signal")
    if signals:
        last = signals[-1]
        return f"{run} ended by {last.value.split(':', 1)[0]}, without an error line (line {last.line_no})"
    return f"{run}; no error line was found"


def helpful(ev: Evidence, limit: int = 8) -> tuple[Fact, ...]:
    """The facts worth showing when nothing fits: the last error lines, the innermost frames,
    the trends, the stack, the numbers, library warnings; at most ``limit``."""
    picked: list[Fact] = []
    picked += list(ev.of("error"))[-2:]
    picked += list(ev.of("frame"))[-2:]
    picked += list(ev.of("trend"))
    picked += list(ev.of("signal"))[-1:] + list(ev.of("told")) + list(ev.of("cut"))
    picked += list(ev.of("number"))
    picked += [f for f in ev.of("library") if re.search(r"\b(?:WARN(?:ING)?|ERROR|W|E)\b", f.value)][-2:]
    picked += list(ev.of("config"))[:3]
    return tuple(dict.fromkeys(picked))[:limit]
