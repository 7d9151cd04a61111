"""CPU threads that share the machine: as many as the CPUs other programs leave free.

PyTorch (and the native kernels) run every op on an OpenMP team of `torch.get_num_threads()`
threads, and each op ends at a barrier. When another program keeps a core busy, the team thread
that shares its core finishes a scheduler time slice late, and the whole team waits at every
barrier (hundreds per step): measured 10-60x slower with one busy neighbour on 2 cores.
Telling OpenMP to sleep instead of spinning at barriers (`OMP_WAIT_POLICY=PASSIVE`) removes the
collapse but halves throughput on a quiet machine (0.24M-parameter model: 21k -> 10k tokens/s),
because every barrier then costs a wake-up.

So the engine keeps OpenMP's defaults and sizes the team instead (`CpuShare`):

- at most the CPUs the process may use (`available_cpus`: its affinity mask, capped by a cgroup
  CPU quota; PyTorch starts one thread per core of the machine even in a container allowed
  fewer), unless OMP_NUM_THREADS chose a number;
- every half second, the CPU time other programs used on those CPUs (from /proc/stat, minus
  this process's own) gives how many CPUs are busy elsewhere; the team shrinks to the CPUs left
  free (at least one), and grows back when they are free again. A change needs two readings in
  a row that agree, so a short burst does not make it flap. The first reading, taken over the
  engine's start-up (`settle`), sets the team at once, so a short run benefits too.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("hybridkv")


def _cgroup_cpus() -> float | None:
    """The CPU quota of this process's cgroup (v2 cpu.max, or v1 cfs quota), in CPUs."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    except (OSError, ValueError):
        pass
    return None


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup quota."""
    cpus = len(_affinity())
    quota = _cgroup_cpus()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def busy_cpu_seconds(cpus: set[int]) -> float | None:
    """CPU seconds spent not idle on `cpus` since boot (/proc/stat), None where unreadable."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy
        busy += sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    return busy / ticks


class CpuShare:
    """Keeps PyTorch's intra-op threads at the CPUs other programs leave free (module doc).
    `tick()` is cheap; the engine calls it once per step."""

    def __init__(self, interval_s: float = 0.5, max_threads: int | None = None) -> None:
        self.fixed = bool(os.environ.get("OMP_NUM_THREADS"))  # the user chose: leave it
        self.max_threads = max_threads or min(torch.get_num_threads(), available_cpus())
        if self.fixed:
            self.max_threads = torch.get_num_threads()
        elif torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)
        self.interval_s = interval_s
        self.cpus = _affinity()
        self.threads = self.max_threads
        self._pending: int | None = None
        self._last = self._reading()

    def _reading(self) -> tuple[float, float, float | None]:
        """(wall seconds, this process's CPU seconds, busy CPU seconds of our CPUs)."""
        return time.monotonic(), time.process_time(), busy_cpu_seconds(self.cpus)

    def others_busy(self) -> float | None:
        """CPUs' worth of time other programs used on our CPUs since the last reading."""
        now = self._reading()
        (wall0, own0, busy0), (wall1, own1, busy1) = self._last, now
        self._last = now
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return None
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (wall1 - wall0))

    def _want(self, others: float) -> int:
        return max(1, min(self.max_threads, round(self.max_threads - others)))

    def _set(self, threads: int, others: float) -> None:
        logger.info("other programs keep %.1f CPUs busy: %d threads", others, threads)
        self.threads = threads
        torch.set_num_threads(threads)

    def settle(self, min_interval_s: float = 0.2) -> int:
        """Set the team from one reading since the last (the engine's start-up), if it spans at
        least `min_interval_s`; returns the threads in use."""
        if self.fixed or self.max_threads == 1:
            return self.threads
        if time.monotonic() - self._last[0] < min_interval_s:
            return self.threads
        others = self.others_busy()
        if others is not None and self._want(others) != self.threads:
            self._set(self._want(others), others)
        return self.threads

    def tick(self) -> int:
        """Re-size the team if a reading is due; returns the threads in use."""
        if self.fixed or self.max_threads == 1:
            return self.threads
        if time.monotonic() - self._last[0] < self.interval_s:
            return self.threads
        others = self.others_busy()
        if others is None:
            return self.threads
        want = self._want(others)
        if want == self.threads:
            self._pending = None
        elif want == self._pending:  # two readings agree: change
            self._pending = None
            self._set(want, others)
        else:
            self._pending = want
        return self.threads
