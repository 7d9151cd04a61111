"""CpuShare sizes PyTorch's thread team to the CPUs other programs leave free."""

from __future__ import annotations

import pytest
import torch

from hybridkv.worker import cpu_threads
from hybridkv.worker.cpu_threads import CpuShare, available_cpus, busy_cpu_seconds


class FakeMachine:
    """A clock, this process's CPU time and the CPUs' busy time, advanced by hand."""

    def __init__(self, monkeypatch):
        self.wall = self.own = self.busy = 0.0
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(cpu_threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(cpu_threads, "busy_cpu_seconds", lambda cpus: self.busy)

    def run(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.wall += seconds
        self.own += seconds * own_cpus
        self.busy += seconds * (own_cpus + other_cpus)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_busy_neighbour_shrinks_the_team_and_an_idle_one_grows_it(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine = FakeMachine(monkeypatch)
    share = CpuShare(interval_s=1.0, max_threads=2)
    assert share.tick() == 2  # no reading due yet
    machine.run(1.0, own_cpus=1.3, other_cpus=0.7)  # a neighbour took most of a CPU
    assert share.tick() == 2  # one reading: not yet
    machine.run(1.0, own_cpus=1.0, other_cpus=1.0)
    assert share.tick() == 1 and torch.get_num_threads() == 1  # two agree: shrink
    machine.run(1.0, own_cpus=1.0, other_cpus=0.0)  # the neighbour stopped
    assert share.tick() == 1
    machine.run(0.5, own_cpus=1.0, other_cpus=0.0)
    assert share.tick() == 1  # not a second's worth yet
    machine.run(0.6, own_cpus=1.0, other_cpus=0.1)
    assert share.tick() == 2 and torch.get_num_threads() == 2


def test_a_short_burst_does_not_flap(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine = FakeMachine(monkeypatch)
    share = CpuShare(interval_s=1.0, max_threads=2)
    for other in (1.0, 0.0, 1.0, 0.0):
        machine.run(1.0, own_cpus=1.0, other_cpus=other)
        assert share.tick() == 2


def test_omp_num_threads_is_left_alone(monkeypatch, threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    machine = FakeMachine(monkeypatch)
    torch.set_num_threads(1)
    share = CpuShare(interval_s=1.0)
    for _ in range(3):
        machine.run(1.0, own_cpus=0.2, other_cpus=0.0)
        assert share.tick() == 1


def test_machine_readings():
    import os

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
    busy = busy_cpu_seconds(set(os.sched_getaffinity(0)))
    assert busy is not None and busy > 0.0  # Linux: /proc/stat is there


def test_settle_sets_the_team_from_the_start_up_reading(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine = FakeMachine(monkeypatch)
    share = CpuShare(max_threads=2)
    machine.run(0.1, own_cpus=1.0, other_cpus=1.0)
    assert share.settle() == 2  # too short a reading to trust
    machine.run(0.5, own_cpus=1.0, other_cpus=1.0)
    assert share.settle() == 1 and torch.get_num_threads() == 1  # one reading is enough
