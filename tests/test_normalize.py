"""The normaliser (troubleshooter/normalize.py): one test per form of mangling issue 36 lists.

Inputs are real texts. Where a public report shows the form, a short excerpt of it is quoted with
its URL (these reports are in the development half of the issue-36 corpus). Otherwise a real
fixture of tests/fixtures/tracebacks/ (a real error, generated or copied verbatim) is mangled the
way the issue documents (underscores to spaces, curly quotes, rank prefixes interleaved, Markdown
around it), and the test checks both the normalised text and that ``explain`` names the same
entry as on the clean fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from troubleshooter import evidence, explain
from troubleshooter.normalize import (
    drop_repeats,
    identifier_vocabulary,
    lift_errors_from_prose,
    normalize,
    python_frames_from_notebooks,
    python_frames_from_rich_boxes,
    rejoin_wrapped,
    split_progress_bars,
    squeeze_spaces,
    strip_rank_prefixes,
    strip_shared_brackets,
    unwrap_hard_wrapped,
)
from troubleshooter.typos import word_vocabulary

TRACEBACKS = Path(__file__).parent / "fixtures" / "tracebacks"


def _fixture(name: str) -> str:
    """A fixture without its '# real: ...' / '# verbatim ...' header line."""
    lines = (TRACEBACKS / name).read_text().splitlines()
    return "\n".join(line for line in lines if not line.startswith("# "))


def _norm(text: str):
    return normalize(text, explain._vocabulary())


def _top(text: str) -> str | None:
    found = explain.explain_text(text)
    return found[0].entry_id if found else None


# -- prose in another language, the exception inside Markdown bullets and backticks ------------

#: https://github.com/thu-coai/CDial-GPT/issues/103 (first line, verbatim)
ZH_PROSE = "执行中报错：RuntimeError: Address already in use"


def test_an_error_inside_prose_in_another_language_gets_a_line_of_its_own():
    norm = _norm(ZH_PROSE)
    assert norm.text.splitlines() == ["执行中报错:RuntimeError: Address already in use",
                                      "RuntimeError: Address already in use"]
    assert norm.lines == (1, 1) and "prose" in norm.steps


def test_an_exception_in_a_backticked_bullet_is_lifted_and_the_entry_named():
    """issue_extension_build_cpu_adam.txt's error line, quoted the way the issue describes:
    a bullet in Chinese prose with the exception in backticks (and curly quotes from the page)."""
    error = _fixture("issue_extension_build_cpu_adam.txt").splitlines()[-1]
    assert error.startswith("AttributeError: 'DeepSpeedCPUAdam'")
    pasted = "我用 DeepSpeed 训练时：\n- 第二次运行报错 `" + error.replace("'", "\u2019") + "` 请问怎么办？\n"
    norm = _norm(pasted)
    assert error in norm.text.splitlines()
    assert _top(pasted) == _top(error) == "extension-build-error"


# -- identifiers mangled by the paste ---------------------------------------------------------


def test_underscores_turned_into_spaces_and_curly_quotes_are_repaired_in_known_identifiers():
    error = _fixture("issue_extension_build_cpu_adam.txt").splitlines()[-1]
    mangled = error.replace("ds_opt_adam", "ds opt adam").replace("'", "\u2018", 1).replace("'", "\u2019")
    assert _top(mangled) == "extension-build-error"
    assert _norm(mangled).text == error
    assert "ds_opt_adam" in identifier_vocabulary([r"object has no attribute 'ds_opt_(?:adam|adagrad)'",
                                                   r"ds_opt_adam\b"])


def test_a_file_path_split_by_a_space_and_a_file_name_with_spaces_are_rejoined():
    """Frames of real_zero3_shape0_linear.txt with the path split at a '/' and a file name's
    underscore turned into a space (as a rendered page does)."""
    text = _fixture("real_zero3_shape0_linear.txt")
    frame = next(line for line in text.splitlines() if "autograd/function.py" in line)
    mangled = frame.replace("autograd/function.py", "autograd/ function.py")
    assert _norm(mangled).text == frame[len("[rank0]: "):]
    logger = next(line for line in text.splitlines() if "c10d_logger.py" in line)
    assert "c10d_logger.py" in _norm(logger.replace("c10d_logger", "c10d logger")).text


# -- two ranks' tracebacks interleaved --------------------------------------------------------


def _rank0_traceback() -> list[str]:
    lines = _fixture("real_zero3_shape0_linear.txt").splitlines()
    return [line for line in lines if line.startswith("[rank0]:")]


def test_two_ranks_interleaved_line_by_line_are_put_back_rank_by_rank():
    ours = _rank0_traceback()
    theirs = [line.replace("[rank0]:", "[rank1]:", 1) for line in ours]
    interleaved = [line for pair in zip(theirs, ours) for line in pair]  # rank 1 first, then 0
    norm = _norm("\n".join(interleaved))
    plain = [line for _, line in squeeze_spaces([(0, line[len("[rank0]: "):]) for line in ours])]
    assert norm.text.splitlines() == plain + plain  # rank 1's block, then rank 0's, each whole
    assert norm.lines[:2] == (1, 3) and norm.input_line(len(plain) + 1) == 2
    assert _top("\n".join(interleaved)) == "zero3-param-not-available"


def test_bare_numeric_rank_prefixes_are_ranks_only_on_three_lines_or_more():
    lines = [(1, "0: Traceback (most recent call last):"), (2, "1: Traceback (most recent call last):"),
             (3, "0: RuntimeError: a"), (4, "1: RuntimeError: b")]
    assert [t for _, t in strip_rank_prefixes(lines)] == ["Traceback (most recent call last):",
                                                          "RuntimeError: a",
                                                          "Traceback (most recent call last):",
                                                          "RuntimeError: b"]
    one = [(1, "1: install the package")]
    assert strip_rank_prefixes(one) == one


def test_unprefixed_interleaving_with_every_line_printed_twice_keeps_each_once():
    plain = [line[len("[rank0]: "):] for line in _rank0_traceback()]
    doubled = [(i, line) for i, line in enumerate((x for line in plain for x in (line, line)), 1)]
    assert [t for _, t in drop_repeats(doubled)] == plain


# -- a message wrapped across lines, or cut ---------------------------------------------------

#: https://github.com/bigcode-project/starcoder/issues/77 (the end of the pasted rich traceback)
WRAPPED = """\
AssertionError: Check batch related parameters. train_batch_size is not
equal to micro_batch_per_gpu * gradient_acc_step * world_size 64 != 4 *
8 * 1
ERROR:torch.distributed.elastic.multiprocessing.api:failed (exi"""


def test_a_message_wrapped_over_three_lines_is_rejoined_and_named():
    norm = _norm(WRAPPED)
    first = norm.text.splitlines()[0]
    assert first.endswith("world_size 64 != 4 * 8 * 1") and norm.lines[0] == 1
    assert norm.text.splitlines()[1].startswith("ERROR:torch")  # the next log line is not joined
    assert _top(WRAPPED) == "batch-arithmetic"


def test_a_short_complete_error_line_is_not_joined_to_the_prose_after_it():
    lines = [(1, "RuntimeError: Address already in use"), (2, "Then I changed the port and it worked.")]
    assert rejoin_wrapped(lines) == lines


# -- Markdown, quotes and prefixes ------------------------------------------------------------


def test_code_fences_block_quotes_and_prefixes_are_removed_and_lines_map_back():
    """issue_cuda_home_assert.txt quoted in a Markdown reply (> and a fence), each line with a
    pdsh host prefix and a timestamp, as a forum reply of a multi-node log shows it."""
    clean = _fixture("issue_cuda_home_assert.txt").splitlines()
    pasted = ["> ```text"] + [f"> node-7: 2024-05-01 10:00:0{i % 10},123 {line}" for i, line in enumerate(clean)]
    pasted.append("> ```")
    norm = _norm("\n".join(pasted))
    assert norm.text.splitlines() == clean
    assert norm.lines == tuple(range(2, len(clean) + 2))
    assert norm.quote(norm.input_line(1)) == pasted[1]  # quoting back gives the input's own line
    assert _top("\n".join(pasted)) == _top("\n".join(clean)) == "cuda-home-missing"


def test_a_host_prefix_before_rank_prefixes_goes_first_so_the_ranks_are_still_put_back():
    """Two ranks of real_zero3_shape0_linear.txt on one node of a pdsh/DeepSpeed multi-node launch."""
    ours = _rank0_traceback()
    theirs = [line.replace("[rank0]:", "[rank1]:", 1) for line in ours]
    pasted = [f"node-2: {line}" for pair in zip(ours, theirs) for line in pair]
    plain = [line for _, line in squeeze_spaces([(0, line[len("[rank0]: "):]) for line in ours])]
    assert _norm("\n".join(pasted)).text.splitlines() == plain + plain


def test_a_word_before_a_colon_on_a_line_or_two_is_not_a_host():
    text = "Error: it failed\nNote: see below\nTraceback (most recent call last):"
    assert _norm(text).text == text


@pytest.mark.parametrize("line, lifted", [
    ("the run stops with torch.cuda.OutOfMemoryError: CUDA out of memory.",
     "torch.cuda.OutOfMemoryError: CUDA out of memory."),
    ("and then the job ended with `AssertionError` and nothing else", "AssertionError"),
    ("then **ValueError: bad value** again", "ValueError: bad value"),
    ("nothing here but a ValueErrorish word", None),
])
def test_error_lines_are_found_after_other_words(line, lifted):
    out = [t for _, t in lift_errors_from_prose([(1, line)])]
    assert out == [line] + ([lifted] if lifted else [])


# -- runs of spaces, prefixes in another order, identifiers only in their own case ---------------

#: https://github.com/OpenRLHF/OpenRLHF/issues/208 (verbatim: a path with two spaces before it,
#: every rank stopping on the same line; the corpus's test/034)
STUCK_ROOT = ("Using  .cache/torch_extensions/py310_cu118 as PyTorch extensions root...\n" * 3
              + "and just choked")


def test_runs_of_spaces_inside_a_line_become_one_and_the_indentation_stays():
    assert squeeze_spaces([(1, "    return f(x)  # note"), (2, "Using  .cache/x as root"),
                           (3, "12345 Killed                  python train.py")]) == [
        (1, "    return f(x) # note"), (2, "Using .cache/x as root"),
        (3, "12345 Killed                  python train.py")]
    assert _norm(STUCK_ROOT).text.splitlines()[0] == (
        "Using .cache/torch_extensions/py310_cu118 as PyTorch extensions root...")
    assert _top(STUCK_ROOT) == "stale-extension-lock"
    # the last line of a paste without its final newline, and text around it, still end the log
    assert _top("I got this:\n```\n" + STUCK_ROOT + "\n```\nany idea?") == "stale-extension-lock"


#: https://github.com/huggingface/diffusers/issues/9579 (first log line, verbatim; the corpus's
#: dev/093), as ``kubectl logs --timestamps`` would print it: the collector's stamp before the rank.
BLOCKING_WAIT = ("[rank3]:[E1002 18:16:40.711756918 ProcessGroupNCCL.cpp:756] [Rank 3] Work WorkNCCL(SeqNum=2521, "
                 "OpType=ALLREDUCE, NumelIn=160672064, NumelOut=160672064, Timeout(ms)=600000) timed out in "
                 "blocking wait.")


def test_a_timestamp_before_the_rank_prefix_is_stripped_first():
    stamped = f"2024-10-02T18:16:40.712345Z {BLOCKING_WAIT}"
    assert _norm(stamped).text == BLOCKING_WAIT[len("[rank3]:"):]
    assert _top(stamped) == _top(BLOCKING_WAIT) == "nccl-watchdog-timeout"


def test_a_host_prefix_before_an_indented_traceback_keeps_the_indentation():
    """issue_cuda_home_assert.txt as pdsh prints it: ``host: `` before every line, frames indented."""
    clean = _fixture("issue_cuda_home_assert.txt").splitlines()
    pasted = [f"worker-7: {line}" for line in clean]
    norm = _norm("\n".join(pasted))
    frames = [line for _, line in squeeze_spaces([(0, c) for c in clean]) if line.lstrip().startswith("File ")]
    assert frames and frames[0].startswith("        File ")
    assert [line for line in norm.text.splitlines() if line.lstrip().startswith("File ")] == frames
    assert _top("\n".join(pasted)) == "cuda-home-missing"


def test_identifiers_are_repaired_only_in_their_own_case():
    vocab = ["deepspeed_config", "ds_numel", "sigkill_handler"]
    text = "set it in the DeepSpeed config\nparam.ds numel is 0\n[launch.py:428:sigkill handler] Killing"
    assert normalize(text, vocab).text.splitlines() == [
        "set it in the DeepSpeed config", "param.ds_numel is 0", "[launch.py:428:sigkill_handler] Killing"]
    assert "sigkill_handler" in explain._vocabulary()  # an evidence term's identifier (cpu-oom's claim)


def _cut_at(text: str, width: int) -> str:
    """Every line cut at ``width`` characters, as a terminal's copy or a mail client leaves it."""
    return "\n".join("\n".join(line[i:i + width] for i in range(0, max(len(line), 1), width))
                     for line in text.split("\n"))


def test_lines_a_terminal_cut_at_one_width_are_joined_back_without_a_space():
    clean = _fixture("issue_nccl_watchdog_new.txt")
    pasted = _cut_at(clean, 80)
    assert pasted.count("\n") > clean.count("\n") + 2
    norm = _norm(pasted)
    assert "hard-wrap" in norm.steps
    long_lines = [line for line in clean.splitlines() if len(line) > 80 and not line.startswith(" ")]
    assert long_lines and all(line.strip() in norm.text for line in long_lines)
    assert _top(pasted) == _top(clean) == "nccl-watchdog-timeout"
    # lines of one width that are a rule, or a text with no line at the longest width three
    # times, are no hard wrap
    assert unwrap_hard_wrapped([(i, "-" * 80) for i in range(5)]) == [(i, "-" * 80) for i in range(5)]
    prose = [(1, "a" * 70), (2, "b" * 70), (3, "short")]
    assert unwrap_hard_wrapped(prose) == prose


# -- output printed on a progress bar's line -----------------------------------------------------

#: https://github.com/eosphoros-ai/DB-GPT/issues/63 (the issue's title, verbatim): the shell's
#: "Killed" on the line of the bar it interrupted (tqdm redraws with a carriage return, no newline)
BAR_KILLED = "Loading checkpoint shards: 0%| | 0/2 [00:00<?, ?it/s]Killed"
#: https://github.com/baichuan-inc/Baichuan2/issues/131 (its first two lines; the bar's run of
#: spaces shortened): the traceback's first line on the bar's line
BAR_TRACEBACK = ("  0%|          | 0/6896 [00:00<?, ?it/s]Traceback (most recent call last):\n"
                 '  File "/home/featurize/work/Baichuan2-main/fine-tune/fine-tune.py", line 153, in <module>')


def test_what_was_printed_after_a_progress_bar_on_its_line_gets_a_line_of_its_own():
    norm = _norm(BAR_KILLED)
    assert norm.text.split("\n") == ["Loading checkpoint shards: 0%| | 0/2 [00:00<?, ?it/s]", "Killed"]
    assert "progress" in norm.steps and norm.lines == (1, 1) and norm.quote(norm.lines[1]) == BAR_KILLED
    assert _top(BAR_KILLED) == "cpu-oom"
    lines = _norm(BAR_TRACEBACK).text.split("\n")
    assert lines[1] == "Traceback (most recent call last):" and lines[2].startswith('  File "/home/')
    # a bar alone, or a bar with nothing after it but spaces, stays as it is
    alone = [(1, " 50%|#####     | 5/10 [00:01<00:01,  3.1it/s]"), (2, "100%|##########| 10/10 [00:02<00:00] ")]
    assert split_progress_bars(alone) == alone


# -- a traceback copied from Jupyter / IPython ----------------------------------------------------

#: https://github.com/pytorch/pytorch/issues/76108 (the first frames and the error, verbatim): IPython 8's
#: frame form, ``File <path>:<line>, in <qualified name>(<arguments>)``.
NOTEBOOK_FRAMES = r"""RuntimeError                              Traceback (most recent call last)
File ~\AppData\Local\Programs\Python\Python39\lib\site-packages\torch\serialization.py:380, in save(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization)
    379 with _open_zipfile_writer(opened_file) as opened_zipfile:
--> 380     _save(obj, opened_zipfile, pickle_module, pickle_protocol)
File ~\AppData\Local\Programs\Python\Python39\lib\site-packages\torch\serialization.py:604, in _save(obj, zip_file, pickle_module, pickle_protocol)
--> 604 zip_file.write_record(name, storage.data_ptr(), num_bytes)

RuntimeError: Could not allocate bytes object!"""
#: https://github.com/zai-org/GLM-4-Voice/issues/114 (one frame line, verbatim): Jupyter's, the
#: location a link.
JUPYTER_LINK_FRAME = ("File [~/miniconda3/lib/python3.10/site-packages/torch/nn/modules/module.py:1736](http://region-3."
                      "seetacloud.com:23008/jupyter/lab/tree/autodl-fs/~/miniconda3/lib/python3.10/site-packages/torch/nn/"
                      "modules/module.py#line=1735), in Module._wrapped_call_impl(self, *args, **kwargs)")


def test_frames_of_a_notebook_traceback_get_pythons_own_form_and_are_read_as_frames():
    norm = _norm(NOTEBOOK_FRAMES)
    assert "notebook-frames" in norm.steps
    first = norm.text.split("\n")[1]
    assert first.startswith('File "~\\AppData\\') and first.endswith('serialization.py", line 380, in save')
    facts = evidence.collect(norm)
    assert [f.value.rsplit("::", 1)[1] for f in facts.of("frame")] == ["save", "_save"]
    assert facts.has("phase", "checkpoint-save")
    assert python_frames_from_notebooks([(1, JUPYTER_LINK_FRAME)]) == [
        (1, 'File "~/miniconda3/lib/python3.10/site-packages/torch/nn/modules/module.py", line 1736, '
            'in _wrapped_call_impl')]
    assert python_frames_from_notebooks([(3, "Cell In[4], line 7")]) == [(3, 'File "<cell In[4]>", line 7, in <module>')]
    # Python's own frame lines and prose that mentions a file stay as they are
    plain = [(1, '  File "/x/train.py", line 3, in <module>'), (2, "File train.py:12, it says, is where it fails")]
    assert python_frames_from_notebooks(plain) == plain


#: IPython 7's layout (before IPython 8): ``<path> in <function>(<arguments>)``, the frame's line
#: on a later ``---> N`` row. Verbatim from a public post on dual numbers (found through the public
#: code index; it is not a thread of the corpus).
IPYTHON7_FRAMES = """AttributeError                            Traceback (most recent call last)
<ipython-input-3-2f7f1012ae70> in <module>()
----> 1 d1 + 4

/Users/damon/ad.py in __add__(self, other)
     11
     12     def __add__(self, other):
---> 13         return DualNumber(self.a + other.a, self.b + other.b)
     14
     15     def __sub__(self, other):

AttributeError: 'int' object has no attribute 'a'"""


def test_frames_of_an_ipython_7_traceback_get_pythons_own_form_with_the_arrows_line():
    norm = _norm(IPYTHON7_FRAMES)
    assert "notebook-frames" in norm.steps
    facts = evidence.collect(norm)
    assert [f.value for f in facts.of("frame")] == ["<ipython-input-3-2f7f1012ae70>::<module>",
                                                    "/Users/damon/ad.py::__add__"]
    assert 'File "/Users/damon/ad.py", line 13, in __add__' in norm.text
    # a sentence with " in " and a path is no frame
    prose = [(1, "/x/train.py in my setup fails")]
    assert python_frames_from_notebooks(prose) == prose



#: https://github.com/zai-org/GLM-4/issues/271 (four rows, verbatim): a traceback rich drew in a box,
#: rank-prefixed, the second frame wrapped before its function's name.
RICH_ROWS = """[rank0]: │ /opt/conda/envs/GLM4/lib/python3.10/site-packages/torch/nn/modules/module.py:1541 in _call_impl  │
[rank0]: │                                                                                                  │
[rank0]: │ /root/.cache/huggingface/modules/transformers_modules/glm-4-9b-chat/modeling_chatglm.py:823 in   │
[rank0]: │ forward                                                                                          │
RuntimeError: 'weight' must be 2-D"""


def test_frames_of_a_traceback_rich_drew_in_a_box_get_pythons_own_form():
    norm = _norm(RICH_ROWS)
    assert "rich-frames" in norm.steps and "hard-wrap" not in norm.steps
    frames = [f.value for f in evidence.collect(norm).of("frame")]
    assert frames == ["/opt/conda/envs/GLM4/lib/python3.10/site-packages/torch/nn/modules/module.py::_call_impl",
                      "/root/.cache/huggingface/modules/transformers_modules/glm-4-9b-chat/modeling_chatglm.py::forward"]
    # rich also wraps a frame before its line number (a narrow box); the box's edges go
    narrow = [(1, "╭──── Traceback (most recent call last) ────╮"), (2, "│ /opt/x/deepspeed/runtime/config.py: │"),
              (3, "│ 891 in _batch_assertion             │"), (4, "╰─────────────────────────────────────╯")]
    assert python_frames_from_rich_boxes(narrow) == [
        (1, "Traceback (most recent call last):"),
        (2, '  File "/opt/x/deepspeed/runtime/config.py", line 891, in _batch_assertion')]


def test_an_exception_run_into_chinese_prose_without_a_space_gets_a_line_of_its_own():
    # https://github.com/hiyouga/LlamaFactory/issues/3852 (verbatim; holdout4 of the issue-36 corpus)
    line = "最新的版本llama-factory，使用KTO进行多机训练过程中再进行验证，报错RuntimeError: still have inglight params"
    lifted = [text for _, text in lift_errors_from_prose([(1, line)])]
    assert lifted == [line, "RuntimeError: still have inglight params"]
    # the tail of a longer word is still no exception of its own
    assert lift_errors_from_prose([(1, "see fooRuntimeError: x")]) == [(1, "see fooRuntimeError: x")]


def test_a_misspelt_word_of_a_retyped_error_line_gets_the_known_word_back():
    # the same report: "inflight" retyped as "inglight", "AVAILABLE" as "AVALIBLE"
    words = word_vocabulary(["still have inflight params", "ds_status == ZeroParamStatus\\.AVAILABLE",
                             "reduced to", "Killing subprocess"])
    text = '报错RuntimeError: still have inglight params [{id：388, "status":"AVALIBLE"}]'
    norm = normalize(text, words=words)
    assert "RuntimeError: still have inflight params" in norm.text and "typos" in norm.steps
    # AVALIBLE is two slips from AVAILABLE (one letter missing, one typed for another): left as it is
    assert "AVALIBLE" in norm.text
    # a word one slip from a known one only at its last letter is another word; prose is not touched
    assert normalize("ValueError: the value reduces to zero", words=words).text.endswith("reduces to zero")
    assert normalize("the inglight params", words=words).text == "the inglight params"
    assert [d.entry_id for d in explain.explain_text(text)] == ["zero3-inflight-params"]


#: https://github.com/databrickslabs/dolly/issues/139 (the end of the pasted traceback, verbatim): a job runner's
#: timestamp and bracketed fields before every line
COLLECTOR = "\n".join(
    "2023-04-29 06:01:12.977 [177/train/578 (pid 28936)] [09c561ee-a44c-4795-967c-7183a83b3160] " + line for line in (
        '  File "/opt/conda/lib/python3.7/site-packages/torch/serialization.py", line 604, in _save',
        "    zip_file.write_record(name, storage.data_ptr(), num_bytes)",
        "OSError: [Errno 28] No space left on device"))


def test_a_job_runners_bracketed_fields_before_every_line_are_stripped():
    assert _norm(COLLECTOR).text.splitlines()[-1] == "OSError: [Errno 28] No space left on device"
    assert '  File "/opt/conda/lib/python3.7/site-packages/torch/serialization.py", line 604, in _save' in (
        _norm(COLLECTOR).text.splitlines())
    assert _top(COLLECTOR) == "checkpoint-disk-full"
    # a library's own fields stay, and so do fields on a line or two only
    deepspeed = [(i, f"[INFO] [engine.py:{80 + i}:__init__] line {i}") for i in range(4)]
    assert strip_shared_brackets(deepspeed) == deepspeed
    two = [(0, "[a/b (pid 1)] x"), (1, "[a/b (pid 1)] y"), (2, "z"), (3, "w")]
    assert strip_shared_brackets(two) == two
