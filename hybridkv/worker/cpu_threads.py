"""CPU threads that share the machine well: how many, and how they wait.

Two things make a CPU engine collapse when another program is busy on the machine:

- **Spinning waits.** By default OpenMP threads spin at the end of every parallel region
  (hundreds per step). When a neighbour holds a core, the thread it displaced finishes its part
  a scheduler time slice late, and every other thread spins, holding its core, until it does:
  measured 10-60x slower with one busy neighbour on 2 cores. With `OMP_WAIT_POLICY=PASSIVE` a
  waiting thread sleeps and gives its core back. OpenMP reads the policy once, when PyTorch
  loads it, so `hybridkv` sets the default when it is imported before torch
  (`set_openmp_defaults`, called by `hybridkv/__init__.py`); a user's own setting wins.
- **More threads than the process may use.** PyTorch starts one thread per core of the machine,
  even where CPU affinity or a cgroup quota (containers) allows fewer. `engine_threads` is the
  number the process may really use; the engine lowers PyTorch's thread count to it unless
  OMP_NUM_THREADS chose one.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
logger = logging.getLogger("hybridkv")

_applied: bool | None = None  # None: set_openmp_defaults never ran


def set_openmp_defaults() -> bool:
    """Set OPENMP_DEFAULTS where the environment has no value, if torch is not loaded yet
    (after that, OpenMP has read its settings). True when they are in force."""
    global _applied
    if _applied is None:
        _applied = "torch" not in sys.modules
        if _applied:
            for key, value in OPENMP_DEFAULTS.items():
                os.environ.setdefault(key, value)
    return _applied or all(os.environ.get(k) for k in OPENMP_DEFAULTS)


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


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpus()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def configure_engine_threads() -> int:
    """Lower PyTorch's intra-op threads to the CPUs the process may use (unless the user set
    OMP_NUM_THREADS); warn once if OpenMP spins because torch was loaded before hybridkv.
    Returns the thread count in force."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        cpus = available_cpus()
        if torch.get_num_threads() > cpus:
            torch.set_num_threads(cpus)
    if not set_openmp_defaults():
        _warn_spinning()
    return torch.get_num_threads()


_warned = False


def _warn_spinning() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "torch was imported before hybridkv, so OpenMP threads spin while they wait: on a "
            "machine where other programs are busy that can cost 10x; set OMP_WAIT_POLICY=PASSIVE "
            "or import hybridkv first"
        )
