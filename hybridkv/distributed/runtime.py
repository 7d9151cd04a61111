"""Tensor-parallel processes: starting them, agreeing on the plan, and running every step.

One scheduler and one cache manager live on rank 0. Each step, rank 0 broadcasts the step
description (the scheduler's `SchedulerOutput` and the rows released since the last step:
plain values) to every rank; every rank runs its shard of the forward on the same page ids;
the vocabulary-parallel lm_head gathers the logits on rank 0, which samples.

    rank 0 (the engine)                         ranks 1.. (workers)
    Engine(model, tensor_parallel_size=N)       spawned by rank 0, or started by torchrun
      start(): spawn workers, join the group      Engine(...): build, join, agree on the plan
      agree_on_plan()                             serve_steps(): loop until told to stop
      step(): DriverRunner.execute(out) ------->    runner.execute(out)  (no sampling)

Two process groups: the default one (gloo on CPUs, NCCL on GPUs) carries the forward's
collectives and the plan check, with `distributed_timeout_s`: a rank that dies or hangs makes
rank 0 fail within it (`TensorParallelError`), never hang. A gloo group with no practical
timeout carries the step descriptions, so idle workers wait for the next step as long as the
engine lives; when rank 0 goes away their wait fails and they exit.

`torchrun --nproc-per-node N [--nnodes ...] -m hybridkv.entrypoints.cli generate ...
--tensor-parallel-size N`: every process builds the engine; rank 0 runs the command and the
others serve steps inside `Engine(...)` and exit when rank 0 is done (env:// rendezvous).
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import datetime
import logging
import os
import socket
import sys
import time
import traceback
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.distributed.parallel import TensorParallel

logger = logging.getLogger("hybridkv")

# Step descriptions hold read-only mappings (MappingProxyType); they travel as plain dicts.
def mapping_proxy(items: dict) -> types.MappingProxyType:
    return types.MappingProxyType(items)


copyreg.pickle(types.MappingProxyType, lambda m: (mapping_proxy, (dict(m),)))
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait this long for the next step
# how long a failed step's error waits for a spawned rank's exit to show (`_dead_ranks`)
DEATH_NOTICE_S = 2.0
_JOIN: tuple[int, int, str] | None = None  # (rank, size, init_method) in a spawned worker
# what the rank-starting server imports once (model construction imports torch._dynamo)
RANK_PRELOAD = ("hybridkv.engine", "torch._dynamo")
# read when torch, its native libraries and hybridkv load (thread pools, CPU dispatch, allocators,
# the native kernels' build target): a forked rank keeps the server's values of these
LOAD_TIME_ENV = (
    "OMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_",
    "LD_", "PYTHON", "HYBRIDKV_",
)  # fmt: skip
# (pid, those variables) of the fork server this module started
_SERVER: tuple[int, dict[str, str]] | None = None
_SPAWNED_ONCE = False  # this process started an engine's ranks before


class TensorParallelError(RuntimeError):
    """A rank died, hung past the timeout or disagreed: the engine cannot go on."""


def check_architecture(architecture: str, size: int) -> None:
    """A one-line error at size > 1 for a family whose modules do not all shard (its model
    class says so: `CausalLM.tensor_parallel`)."""
    from hybridkv.models.registry import MODELS, model_class

    if size == 1 or model_class(architecture).tensor_parallel:
        return
    sharded = sorted(a for a in MODELS if model_class(a).tensor_parallel)
    raise ValueError(
        f"{architecture} does not run with tensor_parallel_size > 1 yet (sharded: "
        f"{', '.join(sharded)}); give tensor_parallel_size=1"
    )


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


@dataclass
class Group:
    """This process's membership: its TensorParallel, the step channel and, on rank 0 when it
    spawned them, the worker processes."""

    tp: TensorParallel
    control: Any
    processes: list[Any] = dataclasses.field(default_factory=list)
    torchrun: bool = False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(LOAD_TIME_ENV)}


def _start_context(mp: Any, device_type: str) -> Any:
    """How ranks 1.. start. A process's first engine spawns them (a new interpreter each: ~2.5
    s of imports); CPU engines after it fork them from a server process that imported torch and
    hybridkv once (Linux, macOS: ~0.2 s a rank), which tests, sweeps and notebooks that build
    engine after engine feel. Spawned instead where forking is unavailable (Windows), when the
    process's fork server is not the one started here (another library's, without these
    imports), or when a variable read as torch loads (`LOAD_TIME_ENV`) changed since it started;
    GPU ranks always spawn (a process forked after anything touched the CUDA driver cannot use
    it, and an import can touch it). Either way a rank runs with this process's environment as
    it is now (`_worker_main` applies it)."""
    global _SERVER, _SPAWNED_ONCE
    import multiprocessing.forkserver as forkserver

    server = getattr(forkserver, "_forkserver", None)
    if (
        device_type != "cpu"
        or "forkserver" not in mp.get_all_start_methods()
        or not hasattr(server, "_forkserver_pid")
    ):
        return mp.get_context("spawn")
    if not _SPAWNED_ONCE:
        _SPAWNED_ONCE = True
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if server._forkserver_pid is None:  # none yet: start ours
        ctx.set_forkserver_preload(list(RANK_PRELOAD))
        server.ensure_running()
        _SERVER = (server._forkserver_pid, _load_time_env())
        return ctx
    if (server._forkserver_pid, _load_time_env()) == _SERVER:
        return ctx
    return mp.get_context("spawn")


def start(
    size: int, timeout_s: float, device_type: str, model: str | None, kwargs: dict[str, Any]
) -> Group:
    """Join (or create) the tensor-parallel group of `size` ranks. Rank 0 of a plain launch
    spawns ranks 1..size-1, each of which builds `Engine(model, **kwargs)` itself."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    processes: list[Any] = []
    torchrun = False
    if _JOIN is not None:
        rank, world, init_method = _JOIN
    elif launched_by_torchrun():
        rank, world, init_method, torchrun = (
            int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", True
        )  # fmt: skip
    else:
        rank, world, init_method = 0, size, f"tcp://127.0.0.1:{_free_port()}"
        ctx = _start_context(mp, device_type)
        for r in range(1, size):
            p = ctx.Process(
                target=_worker_main,
                args=(r, size, init_method, model, kwargs, dict(os.environ)),
                daemon=True,
            )
            p.start()
            processes.append(p)
    if world != size:
        raise ValueError(
            f"tensor_parallel_size={size} but the launch has {world} processes (WORLD_SIZE); "
            "give the same number"
        )
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                                timeout=timeout)  # fmt: skip
        # the step channel: workers wait for the next step as long as it takes; rank 0's
        # sends give up after the timeout (each process sets its own side's timeout)
        control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else IDLE_TIMEOUT)
    except Exception as exc:
        _stop_processes(processes)
        raise TensorParallelError(
            f"the {size} tensor-parallel ranks did not all join within {timeout_s:g} s: {exc}"
        ) from None
    tp = TensorParallel(size, rank, dist.group.WORLD)
    return Group(tp, control, processes, torchrun)


def adopt_environment(environ: dict[str, str]) -> None:
    """Make this process's environment exactly `environ` (a forked rank starts with the
    server's, which predates rank 0's later changes)."""
    os.environ.clear()
    os.environ.update(environ)


def _worker_main(
    rank: int,
    size: int,
    init_method: str,
    model: str | None,
    kwargs: dict[str, Any],
    environ: dict[str, str],
) -> None:
    """A started worker: take rank 0's environment (a forked rank has the server's), then
    build the engine's rank (which serves steps until told to stop)."""
    global _JOIN
    adopt_environment(environ)
    _JOIN = (rank, size, init_method)
    from hybridkv.engine import Engine

    try:
        Engine(model, **kwargs)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def agree_on_plan(plan: Any, tp: TensorParallel) -> Any:
    """Every rank computed its plan; they must be identical but for num_pages, where the
    smallest sets it (the rank with the least memory). Returns the agreed plan."""
    import torch.distributed as dist

    if tp.size == 1:
        return plan
    mine = _plan_summary(plan)
    every: list[Any] = [None] * tp.size
    try:
        dist.all_gather_object(every, (mine, plan.num_pages), group=tp.group)
    except Exception as exc:
        raise TensorParallelError(f"ranks could not exchange their plans: {exc}") from None
    for rank, (summary, _) in enumerate(every):
        if summary != mine:
            diff = {k: (summary[k], v) for k, v in mine.items() if summary.get(k) != v}
            raise TensorParallelError(
                f"rank {rank} planned differently from rank {tp.rank} "
                f"(theirs, ours): {diff}; every rank must run the same model and cache options"
            )
    num_pages = min(n for _, n in every)
    return plan if num_pages == plan.num_pages else dataclasses.replace(plan, num_pages=num_pages)


def _plan_summary(plan: Any) -> dict[str, Any]:
    return {
        "page_tokens": plan.page_tokens,
        "page_bytes": plan.page_bytes,
        "layers_per_group": plan.layers_per_group,
        "max_model_len": plan.max_model_len,
        "groups": [
            (g.kind, g.page_tokens, g.kernel_block_size, g.blocks_per_page, tuple(g.layer_names))
            for g in plan.groups
        ],
    }


# -- steps ----------------------------------------------------------------------------------


def serve_steps(runner: Any, group: Group) -> None:
    """A worker's life after set-up: run every step rank 0 broadcasts, until it says stop."""
    import torch.distributed as dist

    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group.control)
        if box[0] is None:
            return
        releases, out = box[0]
        for ids, finished in releases:
            runner.release(ids, finished)
        runner.execute(out)


class DriverRunner:
    """Rank 0's runner: broadcasts each step (and the rows released since the last) to the
    workers, then runs its own shard and samples. Any failure is fatal: the ranks could be out
    of step, so the engine stops (`TensorParallelError`) instead of going on."""

    def __init__(self, runner: Any, group: Group, timeout_s: float) -> None:
        self.runner = runner
        self.group = group
        self.timeout_s = timeout_s
        self.pending: list[tuple[list[str], bool]] = []
        self.failed: str | None = None
        self.closed = False

    def __getattr__(self, name: str) -> Any:  # rows, tables, buffers, ... of the local runner
        return getattr(self.runner, name)

    def release(self, request_ids: Iterable[str], finished: bool = True) -> None:
        ids = list(request_ids)
        if ids:
            self.pending.append((ids, finished))
        self.runner.release(ids, finished)

    def execute(self, out: Any) -> Any:
        import torch.distributed as dist

        self._check()
        try:
            box = [(self.pending, out)]
            dist.broadcast_object_list(box, src=0, group=self.group.control)
            self.pending = []
            return self.runner.execute(out)
        except Exception as exc:
            self.failed = self._describe(exc)
            raise TensorParallelError(self.failed) from None

    def _check(self) -> None:
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        dead = [
            (r, p.exitcode) for r, p in enumerate(self.group.processes, 1) if not p.is_alive()
        ]
        if dead:
            rank, code = dead[0]
            self.failed = f"tensor-parallel rank {rank} exited (exit code {code}); the engine stops"
            raise TensorParallelError(self.failed)

    def _describe(self, exc: Exception) -> str:
        dead = self._dead_ranks(wait_s=DEATH_NOTICE_S)
        if dead:
            return f"tensor-parallel rank {dead[0]} died during a step; the engine stops ({exc})"
        return (
            f"a tensor-parallel step failed or a rank did not answer within "
            f"{self.timeout_s:g} s; the engine stops ({exc})"
        )

    def _dead_ranks(self, wait_s: float) -> list[int]:
        """The spawned ranks that have exited, waiting up to `wait_s` for one to show: a killed
        rank's sockets close while its process is still exiting, so the collective that failed
        on them can be faster than `is_alive()` (the error then named no rank)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r, p in enumerate(self.group.processes, 1) if not p.is_alive()]
            if dead or not self.group.processes or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def abandon(self) -> None:
        """Rank 0 failed before the first step: end the workers without telling them."""
        self.failed = self.failed or "the engine failed while it was set up"
        self.shutdown()

    def shutdown(self) -> None:
        """Tell the workers to stop (when they can still hear it) and end their processes."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        failed = self.failed is not None
        if not failed:
            with contextlib.suppress(Exception):  # a worker already gone: nothing to tell
                dist.broadcast_object_list([None], src=0, group=self.group.control)
        _stop_processes(self.group.processes, wait_s=0.5 if failed else 5.0)
        self.failed = self.failed or "the engine was shut down"
        # only this engine's groups (a later engine of this process may have its own)
        if dist.is_initialized() and dist.group.WORLD is self.group.tp.group:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _stop_processes(processes: list[Any], wait_s: float = 5.0) -> None:
    for p in processes:
        p.join(timeout=wait_s)
        if p.is_alive():
            p.terminate()
            p.join(timeout=wait_s)
