"""The driver's failure messages (hybridkv.distributed.runtime.DriverRunner), without processes."""

from __future__ import annotations

import os

import pytest

from hybridkv.distributed import runtime
from hybridkv.distributed.runtime import DriverRunner, Group


class ExitingProcess:
    """A spawned rank that was killed: its sockets are closed (the step failed) but the first
    `polls` checks still see it alive, as while the kernel tears the process down."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.exitcode = None

    def is_alive(self) -> bool:
        self.polls -= 1
        if self.polls < 0:
            self.exitcode = -9
        return self.polls >= 0


def test_a_failed_step_names_the_rank_whose_exit_shows_late():
    driver = DriverRunner(None, Group(tp=None, control=None, processes=[ExitingProcess(5)]), 5.0)
    message = driver._describe(RuntimeError("Connection closed by peer"))
    assert message.startswith("tensor-parallel rank 1 died during a step"), message


def test_a_hung_rank_is_reported_as_such_after_the_wait(monkeypatch):
    monkeypatch.setattr(runtime, "DEATH_NOTICE_S", 0.05)
    driver = DriverRunner(None, Group(tp=None, control=None, processes=[ExitingProcess(10**9)]), 5)
    message = driver._describe(RuntimeError("timed out"))
    assert "did not answer within 5 s" in message, message


class FakeForkServer:
    """multiprocessing's fork server as `_start_context` sees it: a pid once running."""

    def __init__(self, pid: int | None = None) -> None:
        self._forkserver_pid = pid

    def ensure_running(self) -> None:
        self._forkserver_pid = self._forkserver_pid or 4242


def test_cpu_ranks_fork_from_the_server_until_a_load_time_variable_changes(monkeypatch):
    """A process's first CPU engine spawns its ranks; later ones fork them from the server it
    starts, while the variables read as torch loads stay the same; GPU ranks always spawn."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        assert runtime._start_context(mp, "cpu").get_start_method() == "spawn"
        return
    monkeypatch.setattr(forkserver, "_forkserver", FakeForkServer())
    monkeypatch.setattr(runtime, "_SERVER", None)
    monkeypatch.setattr(runtime, "_SPAWNED_ONCE", False)
    monkeypatch.delenv("OMP_SCHEDULE", raising=False)
    assert runtime._start_context(mp, "cuda").get_start_method() == "spawn"
    assert runtime._start_context(mp, "cpu").get_start_method() == "spawn"  # the first
    assert runtime._start_context(mp, "cpu").get_start_method() == "forkserver"
    assert runtime._SERVER[0] == 4242
    monkeypatch.setenv("HKV_TEST_UNRELATED", "1")  # not read as torch loads: still forked
    assert runtime._start_context(mp, "cpu").get_start_method() == "forkserver"
    monkeypatch.setenv("OMP_SCHEDULE", "static")
    assert runtime._start_context(mp, "cpu").get_start_method() == "spawn"
    monkeypatch.delenv("OMP_SCHEDULE")
    assert runtime._start_context(mp, "cpu").get_start_method() == "forkserver"
    assert runtime._start_context(mp, "cuda").get_start_method() == "spawn"


def test_a_fork_server_this_module_did_not_start_is_not_used(monkeypatch):
    """Another library's server (or one restarted since) lacks the imports and may have another
    environment: ranks spawn."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no fork server on this platform (ranks always spawn)")
    monkeypatch.setattr(forkserver, "_forkserver", FakeForkServer(pid=999))
    monkeypatch.setattr(runtime, "_SPAWNED_ONCE", True)
    monkeypatch.setattr(runtime, "_SERVER", None)
    assert runtime._start_context(mp, "cpu").get_start_method() == "spawn"
    monkeypatch.setattr(runtime, "_SERVER", (1000, runtime._load_time_env()))
    assert runtime._start_context(mp, "cpu").get_start_method() == "spawn"


def report_environment(environ: dict[str, str], names: list[str], queue) -> None:
    runtime.adopt_environment(environ)
    queue.put({n: os.environ.get(n) for n in names})


def test_a_forked_rank_runs_with_rank_0s_environment_of_now(monkeypatch):
    """Through the server `_start_context` starts (the one later engines of this test process
    use too): a variable set after the server started reaches the rank, and one removed is gone
    (that half can only fail where this test started the server: it had the variable then)."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no fork server on this platform (ranks always spawn)")
    monkeypatch.setenv("HKV_TEST_GONE", "old")
    monkeypatch.setattr(runtime, "_SPAWNED_ONCE", True)
    ctx = runtime._start_context(mp, "cpu")
    assert ctx.get_start_method() == "forkserver"
    monkeypatch.setenv("HKV_TEST_NEW", "new")
    monkeypatch.delenv("HKV_TEST_GONE")
    queue = ctx.Queue()
    p = ctx.Process(
        target=report_environment,
        args=(dict(os.environ), ["HKV_TEST_NEW", "HKV_TEST_GONE"], queue),
    )
    p.start()
    assert queue.get(timeout=60) == {"HKV_TEST_NEW": "new", "HKV_TEST_GONE": None}
    p.join(timeout=30)
    assert p.exitcode == 0
