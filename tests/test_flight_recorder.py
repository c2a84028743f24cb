"""The Flight Recorder's switch (the user's settings win) and the on-demand dump on SIGUSR1.

The dump test is a real one-rank gloo group in a child process: it records one all-reduce, then
blocks its main thread; ``troubleshooter hang-dump`` (the real CLI) signals it through its process
file, and the rank's watcher thread writes the trace torch's reader loads.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from lightning_zeromoe.engine import flight_recorder
from support.jobs import REPO, free_port, job_env


def test_on_by_default_and_the_users_settings_win(tmp_path):
    env: dict[str, str] = {}
    assert flight_recorder.DEFAULT_BUFFER == 2000  # the figure docs/guides/hangs.md names
    assert flight_recorder.enable(flight_recorder.DEFAULT_BUFFER, tmp_path, env).users_own is False
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "rank")}
    env = {"TORCH_FR_BUFFER_SIZE": "64", "TORCH_FR_DUMP_TEMP_FILE": "/elsewhere/trace_"}
    settings = flight_recorder.enable(2000, tmp_path, env)
    assert (settings.buffer, settings.users_own) == (64, True)
    assert env == {"TORCH_FR_BUFFER_SIZE": "64", "TORCH_FR_DUMP_TEMP_FILE": "/elsewhere/trace_"}
    env = {}
    assert flight_recorder.enable(0, tmp_path, env).buffer == 0 and env == {"TORCH_FR_BUFFER_SIZE": "0"}


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from lightning_zeromoe.engine import flight_recorder
    directory = Path(sys.argv[1])
    flight_recorder.enable(100, directory)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    recorder = flight_recorder.Recorder(directory, 0, 1)
    recorder.announce()
    dist.all_reduce(torch.ones(3))
    print("ready", flush=True)
    time.sleep(120)
""")


def test_sigusr1_makes_a_blocked_rank_write_its_trace(tmp_path):
    env = dict(job_env(), PYTHONPATH=str(REPO))
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(free_port())], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        proc = subprocess.run([sys.executable, "-m", "troubleshooter", "hang-dump", str(tmp_path), "--wait", "30"],
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        assert f"rank 0 (pid {child.pid}): sent" in proc.stderr, proc.stderr
        dump = pickle.loads((tmp_path / "rank0").read_bytes())
        ops = [(e["profiling_name"], e["input_sizes"]) for e in dump["entries"]]
        assert ("gloo:all_reduce", [[3]]) in ops, ops
        assert child.poll() is None  # the signal did not end it
    finally:
        child.kill()
        child.wait()


SLOW_PEER = textwrap.dedent("""
    import json, os, signal, socket, sys, time
    from pathlib import Path
    directory, delay = Path(sys.argv[1]), float(sys.argv[2])

    def answer(*_):
        time.sleep(delay)  # a rank on a busy machine, slow to answer
        (directory / "rank1").write_bytes(b"rank 1's trace")

    signal.signal(signal.SIGUSR1, answer if delay >= 0 else signal.SIG_IGN)
    (directory / "process1.json").write_text(json.dumps({"rank": 1, "world_size": 2, "pid": os.getpid(),
                                                         "host": socket.gethostname(), "script": "slow_peer.py"}))
    print("ready", flush=True)
    time.sleep(120)
""")


def _peer(tmp_path: Path, delay: float) -> subprocess.Popen:
    script = tmp_path / "slow_peer.py"
    script.write_text(SLOW_PEER)
    peer = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(delay)], stdout=subprocess.PIPE, text=True)
    assert peer.stdout.readline().strip() == "ready"
    return peer


def test_a_failing_rank_waits_for_the_other_ranks_traces(tmp_path, monkeypatch):
    """Once the failing rank exits, Lightning's launcher SIGKILLs the others within seconds: a peer that had not
    yet written its trace left none (the uneven-batches hang lost rank 0's now and then). The failing rank
    (this process, the real ``Flight.failed``) now returns only when the peer (a real process that takes 2 s to
    answer ``SIGUSR1``) has written its trace."""
    from lightning_zeromoe.engine import group_exit

    monkeypatch.setattr(group_exit.STATE, "failed", False)  # failed() marks it; this process is pytest's
    peer = _peer(tmp_path, delay=2.0)
    try:
        flight = flight_recorder.Flight(True)
        flight.recorder = flight_recorder.Recorder(tmp_path, 0, 2)
        flight.failed(RuntimeError("Timed out waiting 6000ms for recv operation to complete"), rank=0)
        assert (tmp_path / "rank0").exists()
        assert (tmp_path / "rank1").read_bytes() == b"rank 1's trace"
    finally:
        peer.kill()
        peer.wait()


def test_the_wait_for_a_silent_rank_is_bounded(tmp_path):
    from lightning_zeromoe import hang_dumps

    peer = _peer(tmp_path, delay=-1)  # ignores the signal
    try:
        start = time.monotonic()
        outcome = hang_dumps.request_and_wait(tmp_path, wait=1.0)
        assert outcome == [(1, peer.pid, "no dump within the wait")]
        assert 1.0 <= time.monotonic() - start < 10
    finally:
        peer.kill()
        peer.wait()


ABORTING_PAIR = textwrap.dedent("""
    import os, sys, threading
    from datetime import timedelta
    from pathlib import Path
    import torch, torch.distributed as dist
    from lightning_zeromoe.engine import collectives, flight_recorder
    directory, port, rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    flight_recorder.enable(100, directory)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    recorder = flight_recorder.Recorder(directory, rank, 2)
    recorder.announce()
    dist.all_reduce(torch.ones(3))  # both ranks agree on the first collective

    # the steps' collectives are a library's (as a model's are), issued through this package's own
    def validation_step():  # rank 0: one batch short, it evaluates, and dies inside the collective
        threading.Timer(2.0, os.abort).start()
        collectives.all_reduce(torch.ones(5))

    def training_step():  # rank 1: still training, waits for a peer that is gone
        try:
            collectives.broadcast(torch.ones(7), src=1)
            collectives.all_reduce(torch.ones(7))
        except RuntimeError as error:
            recorder.dump(f"{type(error).__name__}: {error}")

    validation_step() if rank == 0 else training_step()
""")


def test_a_rank_that_aborts_inside_a_collective_leaves_its_side_in_its_stacks(tmp_path):
    """A rank that dies of a fatal error writes no trace: gloo's size check on a mismatched collective aborts
    the process from its I/O thread (the uneven-batches hang ended that way in 3 of 10 launches here), NCCL's
    watchdog aborts on a timeout. Its Python stacks, written by faulthandler to ``stacks<N>.txt``, give its
    side. Two real gloo ranks: rank 0 aborts (``os.abort`` from a timer thread stands in for gloo's own abort:
    the same SIGABRT) while its main thread is in ``all_reduce`` in ``validation_step``; rank 1 waits in
    ``training_step`` and dumps when the connection drops."""
    from troubleshooter import hangs

    env = dict(job_env(), PYTHONPATH=str(REPO))
    for name in ("TORCH_FR_BUFFER_SIZE", "PYTHONFAULTHANDLER"):
        env.pop(name, None)
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", ABORTING_PAIR, str(tmp_path), port, str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert ranks[0].returncode == -signal.SIGABRT, outputs[0][-2000:]
    assert "Fatal Python error: Aborted" in (tmp_path / "stacks0.txt").read_text()
    assert (tmp_path / "stacks1.txt").read_text() == ""  # rank 1 lived: nothing written
    report = hangs.analyse(tmp_path)
    text = "\n".join(report.lines())
    assert report.missing == [0] and report.entry_id == "hang-uneven-batches", text
    dead = next(op for op in report.divergence.issued if op.rank == 0)
    assert (dead.name, dead.phase, dead.died) == ("all_reduce", "validation_step", "Fatal Python error: Aborted")
    assert {op.phase for op in report.divergence.issued} == {"training_step", "validation_step"}, text
    assert "rank 0 was in all_reduce" in text and "stacks0.txt" in text, text
