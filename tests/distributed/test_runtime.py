"""The driver's failure messages (hybridkv.distributed.runtime.DriverRunner), without processes."""

from __future__ import annotations

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
