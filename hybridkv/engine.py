"""The engine: model + memory plan + cache manager + scheduler + runner, one step at a time.

    engine = Engine(model="path/to/checkpoint", dtype="float32")
    req = engine.add_request("def fib(n):", SamplingParams(max_tokens=32))
    while engine.has_unfinished:
        for update in engine.step(): ...      # RequestOutput of every request that advanced

Requests are validated before they enter the engine (a ValueError names the bad value);
nothing about a rejected request touches the cache or the other requests.

Set-up, in order (`Engine.__init__`):

    1. read config.json once into the family's typed config (transformers' defaults)
    2. resolve the device, dtype, platform, max_model_len, cache dtypes and what the machine
       has (native kernels, Triton) in one place: `resolve_runtime`
    3. build the model on the meta device and collect the cache layers it declares
    4. make the memory plan, once
    5. materialise the model on the device and load its weights
    6. cache manager, scheduler, runner (which allocates the cache and binds it to the model)

With `tensor_parallel_size=N` (`hybridkv.distributed`), rank 0 starts ranks 1..N-1 (or joins a
torchrun launch) before step 3; every rank builds its shard of the model, the ranks agree on
the plan before any cache is allocated, and only rank 0 keeps a cache manager and scheduler:
the other ranks run the steps it broadcasts and never return from `Engine(...)`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import os
import sys
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.config import (
    CacheConfig,
    ParallelConfig,
    SchedulerConfig,
    check_bools,
    check_quantization,
    split_kwargs,
)
from hybridkv.core.coordinator import CacheManager
from hybridkv.core.request import Request, RequestStatus
from hybridkv.core.scheduler import Scheduler, SchedulerOutput, with_drafts
from hybridkv.distributed.parallel import SINGLE, building
from hybridkv.distributed.runtime import (
    DriverRunner,
    TensorParallelError,
    agree_on_plan,
    check_architecture,
    serve_steps,
)
from hybridkv.distributed.runtime import start as start_group
from hybridkv.dtypes import canonical_dtype, torch_dtype
from hybridkv.kv.plan import MemoryPlan, PlanTarget, keeps_positions, make_speculative_plan
from hybridkv.kv.presets import load_model_config
from hybridkv.kv.specs import CacheDtypes
from hybridkv.layers.attention.registry import BACKENDS, get_backend
from hybridkv.layers.linear import prepack_linears
from hybridkv.layers.quantization import QuantizationReport, quantize_model
from hybridkv.models.base import CausalLM
from hybridkv.models.config_helpers import model_dtype, resolve_cache_dtypes, text_config
from hybridkv.models.hf_config import HFConfig
from hybridkv.models.loader import eos_token_ids, generation_config, iter_weights
from hybridkv.models.registry import architecture_of, model_class
from hybridkv.outputs import CompletionOutput, RequestOutput
from hybridkv.sampling_params import MAX_SEED, SamplingParams, check_unicode
from hybridkv.spec_decode.config import SpeculativeConfig
from hybridkv.spec_decode.metrics import SpecDecodeStats
from hybridkv.spec_decode.ngram import NgramProposer
from hybridkv.spec_decode.verify import Verified, verify_step
from hybridkv.tokenizer import load_tokenizer
from hybridkv.worker.cpu_threads import CpuShare
from hybridkv.worker.host_memory import keep_freed_memory
from hybridkv.worker.model_runner import ModelRunner, StepLogits
from hybridkv.worker.sampler import Sample, Sampler, SamplingRow, fill_bitmasks

DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"
MIN_REQUEST_TOKENS = 16  # the shortest request a pool must hold (else the engine refuses it)
# More characters than any one token of a real vocabulary holds (the longest are runs of
# spaces or dashes, under 100 characters).
MAX_CHARS_PER_TOKEN = 256
GREEDY = SamplingParams(temperature=0.0)
NOTHING_VERIFIED = Verified({}, {})  # a step without drafts
logger = logging.getLogger("hybridkv")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how.

    - `model`: a folder with config.json, safetensors and tokenizer.json (None: the built-in
      default model). Without tokenizer.json it runs in token-id mode: prompts are lists of
      token ids, outputs have token ids and empty text, and stop strings are refused.
    - `dtype`: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16" (on the
      CPU float16 runs the PyTorch ops: the native kernels take float32 and bfloat16).
    - `device`: "auto" (CUDA if available, else CPU), "cpu" or "cuda".
    - `prepack`: CPU: oneDNN pre-packed linear weights (`hybridkv.layers.linear`).
    - `compile`: let state layers run a torch.compile'd decode step (the "compiled" ops, slow
      first step) where the native CPU kernels (`hybridkv.ops.native`) cannot: no C compiler,
      or a bf16 state.
    - `keep_freed_memory`: CPU on glibc: reuse large freed blocks instead of returning them to
      the OS after every step (`hybridkv.worker.host_memory`; process-wide).
    - `quantization`: None, "int8": weight-only int8 linears with per-output-row scales,
      computed from the loaded weights, or "w8a8": the same weights with the activations
      rounded to int8 per token at each linear (AMX-INT8 tiles; `hybridkv.layers.quantization`;
      CPU only). The cache (KV and states) keeps its dtypes.
    - `max_capture_size`: CPU, one process: decode steps of up to this many requests are
      captured as native programs and replayed without Python (`hybridkv.worker.graphs`);
      0 runs every step eagerly. `enforce_eager=True` (vLLM's name) does the same.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    prepack: bool = True
    compile: bool = False
    keep_freed_memory: bool = True
    quantization: str | None = None
    max_capture_size: int = 16
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str | Path):
            raise ValueError(f"model must be a folder path, got {self.model!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.seed > MAX_SEED:
            raise ValueError(f"seed must be at most {MAX_SEED}, got {self.seed}")
        check_bools(self, "prepack", "compile", "keep_freed_memory", "enforce_eager")
        size = self.max_capture_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"max_capture_size must be an integer >= 0, got {size!r}")
        if not isinstance(self.dtype, str) or not isinstance(self.device, str):
            raise ValueError(f"dtype and device must be names, got {self.dtype!r}, {self.device!r}")
        allowed = ("float32", "bfloat16", "float16")
        try:
            ok = self.dtype == "auto" or canonical_dtype(self.dtype) in allowed
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        check_quantization(self.quantization)

    @property
    def folder(self) -> Path:
        return Path(self.model).expanduser() if self.model else DEFAULT_MODEL


@dataclass(frozen=True)
class Runtime:
    """Everything about where and how the model runs, resolved once before anything is built."""

    device: torch.device
    dtype: str  # the model's compute dtype
    max_model_len: int
    cache: CacheConfig  # platform set from the device
    scheduler: SchedulerConfig  # max_model_len resolved
    cache_dtypes: CacheDtypes
    capabilities: frozenset[str]  # what the machine has: "native", "triton", "compile"

    def plan_target(self) -> PlanTarget:
        sized_by_user = self.cache.memory_bytes is not None or self.cache.num_pages is not None
        return PlanTarget(
            self.max_model_len,
            None if sized_by_user else self.scheduler.max_num_seqs,
            self.dtype,
            self.capabilities,
        )


def resolve_runtime(
    model_config: ModelConfig,
    cache: CacheConfig,
    scheduler_kwargs: dict[str, Any],
    hf_config: dict[str, Any],
    family: HFConfig,
) -> Runtime:
    """Device (auto: CUDA if available), dtype (auto: the checkpoint's), platform (from the
    device), max_model_len (the model's max_position_embeddings unless given), cache dtypes and
    the machine's capabilities, for the plan and the runner to share."""
    want = model_config.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    device = torch.device(want)
    if model_config.quantization is not None and device.type != "cpu":
        raise ValueError(
            f"quantization={model_config.quantization!r} runs on the CPU only (its kernel, "
            f"torch's _weight_int8pack_mm, is a naive loop on CUDA); give device='cpu' or no "
            "quantization"
        )
    dtype = model_config.dtype
    dtype = model_dtype(hf_config) if dtype == "auto" else canonical_dtype(dtype)
    if cache.platform == "cpu" and device.type == "cuda":
        cache = dataclasses.replace(cache, platform="cuda")
    scheduler = SchedulerConfig(**scheduler_kwargs)  # validates the values first
    limit = family.max_position_embeddings
    max_model_len = scheduler.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the model's limit of {limit} tokens "
            "(max_position_embeddings in its config.json); give at most that"
        )
    scheduler = dataclasses.replace(scheduler, max_model_len=max_model_len)
    runtime_config = {**hf_config, "torch_dtype": dtype, "dtype": dtype}
    dtypes = resolve_cache_dtypes(
        runtime_config, cache.kv_cache_dtype, cache.state_dtype, cache.ssm_state_dtype
    )
    return Runtime(
        device, dtype, max_model_len, cache, scheduler, dtypes, _capabilities(device, model_config)
    )


def _capabilities(device: torch.device, model_config: ModelConfig) -> frozenset[str]:
    found = set()
    if device.type == "cpu":
        from hybridkv.ops import native

        if native.library() is not None:  # builds the kernels once (about a second)
            found.add("native")
    # Triton compiles for GPUs; on a CPU only its interpreter runs kernels (TRITON_INTERPRET=1,
    # read when a kernel module is imported).
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
        except ImportError:
            pass
        else:
            found.add("triton")
            # flash-linear-attention (fla-core): its kernels for the linear-attention kinds
            if device.type == "cuda" and importlib.util.find_spec("fla") is not None:
                found.add("fla")
    if model_config.compile:
        found.add("compile")
    return frozenset(found)


def _check_runnable(plan: MemoryPlan) -> None:
    """Every group of the plan has kernels hybridkv implements (before any weight loads): the
    backend's own, or those of the backend it runs on (`runs_on`: FlashMLA's layout on Triton's
    MLA kernels)."""
    for group in plan.attention_groups:
        assert group.backend is not None
        info = get_backend(group.backend)
        if info.runner is None:
            implemented = ", ".join(n for n, b in BACKENDS.items() if b.impl is not None)
            raise ValueError(
                f"attention backend {group.backend!r} is declared for planning only; this "
                f"engine runs: {implemented}"
            )


class Engine:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        mkw, ckw, skw, pkw = split_kwargs(
            kwargs, ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig
        )
        self.parallel_config = ParallelConfig(**pkw)
        self.model_config = ModelConfig(model=model, **mkw)
        folder = self.model_config.folder
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model {str(folder)!r} is not a folder with config.json and "
                "safetensors weights (and tokenizer.json for text prompts)"
            )
        hf_config = load_model_config(folder)
        self.architecture = architecture_of(hf_config)
        cls = model_class(self.architecture)
        tp_size = self.parallel_config.tensor_parallel_size
        check_architecture(self.architecture, tp_size)
        family = cls.config_class.from_hf(text_config(hf_config))  # the one reading
        rt = resolve_runtime(self.model_config, CacheConfig(**ckw), skw, hf_config, family)
        self.runtime = rt
        self.device, self.dtype, self.max_model_len = rt.device, rt.dtype, rt.max_model_len
        self.cache_config, self.scheduler_config = rt.cache, rt.scheduler
        self.speculative_config = self._resolve_speculation(str(folder), tp_size, family)
        # CPU: as many threads as the CPUs other programs leave free (re-read every second)
        self.cpu_share = CpuShare() if self.device.type == "cpu" else None
        if self.device.type == "cpu" and self.model_config.keep_freed_memory:
            keep_freed_memory()
        self.tokenizer = load_tokenizer(folder)  # None: token-id mode (no tokenizer.json)

        # tensor parallel: join (rank 0: start) the group; every rank builds its shard
        self.group = None if tp_size == 1 else start_group(
            tp_size, self.parallel_config.distributed_timeout_s, self.device.type, model, kwargs
        )  # fmt: skip
        self.tp = SINGLE if self.group is None else self.group.tp
        try:
            runner = self._build_rank(cls, family, folder)
        except BaseException:
            if self.group is not None and self.tp.rank == 0:
                DriverRunner(None, self.group, 0).abandon()  # no orphaned workers
            raise
        if self.group is not None and self.tp.rank != 0:
            self._serve_as_worker(runner)  # returns only by SystemExit
        self.runner: Any = runner
        if self.group is not None:
            timeout = self.parallel_config.distributed_timeout_s
            self.runner = DriverRunner(runner, self.group, timeout)
            weakref.finalize(self, self.runner.shutdown)

        self.cache = CacheManager(self.plan, self.cache_config)
        spec = self.speculative_config
        mtp = spec is not None and spec.method == "mtp"
        self.proposer = None if spec is None or mtp else NgramProposer.from_config(spec)
        self.spec_stats = SpecDecodeStats()
        drafter = self._mtp_placeholders if mtp else self._drafts
        self.scheduler = Scheduler(
            self.cache,
            self.scheduler_config,
            None if spec is None else drafter,
            self._num_scratch_rows(),
            mtp=mtp,
            keeps_positions=self._num_scratch_positions() > 0,
            capturable=self._capturable,
        )
        if spec is not None:
            scratch = self.plan.reserved_bytes
            where = "on top of num_pages" if self.cache_config.num_pages else "from the budget"
            how = "the checkpoint's MTP layer" if mtp else (
                f"prompt lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max}"
            )  # fmt: skip
            k = f"k={spec.num_speculative_tokens}"
            schedule = spec.num_speculative_tokens_per_batch_size
            if schedule is not None:
                k += f" per batch size {[list(e) for e in schedule]}"
            if spec.adaptive_k:
                k += " (adaptive: at most)"
            rollback = (
                f"{self._num_scratch_positions()} states kept per row (rejections commit the "
                "accepted position)" if self._num_scratch_positions()
                else "states saved per row (rejections rewind)"
            )  # fmt: skip
            logger.info(
                "speculative decoding: %s, %s, %s; %d state scratch rows (of %d requests that may "
                "draft), %s (%.1f MiB %s)", spec.method, k, how, self._num_scratch_rows(),
                self._drafting_rows(), rollback, scratch / 2**20, where,
            )  # fmt: skip
        self.eos_token_ids = eos_token_ids(text_config(hf_config), generation_config(folder))
        self.vocab_size = family.vocab_size
        self.requests: dict[str, Request] = {}
        self._held: dict[str, list[Request]] = {}  # request id -> requests waiting for its prompt
        self.sampler = Sampler(self.model_config.seed)
        self._grammars: Any = None  # hybridkv.structured.GrammarCompiler, made when first needed
        self._mask_thread: ThreadPoolExecutor | None = None  # fills grammar masks (_start_masks)
        self._ids = itertools.count()
        if self.cpu_share is not None:
            self.cpu_share.settle()  # from what other programs did while the engine started

    # -- set-up --------------------------------------------------------------------------------

    def _log_ops(self) -> None:
        """The CPU line and the op implementations chosen for this model's dtypes (rank 0)."""
        self.op_table: list[tuple[str, str, str]] = []  # (op, dtype, implementation)
        if self.device.type != "cpu" or self.tp.rank != 0:
            return
        from hybridkv.ops import registry
        from hybridkv.ops.native import cpu

        dtypes = [self.runtime.dtype]
        dtypes += [g.spec.dtype for g in self.plan.attention_groups if g.spec.dtype not in dtypes]
        self.op_table = registry.table("cpu", dtypes)
        logger.info("%s", cpu.line())
        logger.info("ops:\n%s", registry.format_table(self.op_table))

    def _build_rank(self, cls: type[CausalLM], family: HFConfig, folder: Path) -> ModelRunner:
        """This rank's model (its shard under tensor parallelism), the plan every rank agreed
        on, the weights and the runner that allocates the cache."""
        rt = self.runtime
        spec = self.speculative_config
        with building(self.tp), torch.device("meta"):
            meta_model = cls(family)
            if spec is not None and spec.method == "mtp":
                meta_model.build_mtp()  # its attention layers join the plan like any other
        layers = meta_model.cache_layers(rt.cache_dtypes)
        # speculative decoding's state scratch comes out of the same budget as the pages
        k = 0 if spec is None else spec.num_speculative_tokens or 0
        plan = make_speculative_plan(
            layers, self.cache_config, self.architecture, rt.plan_target(),
            self._drafting_rows(), k,
        )  # fmt: skip
        plan = dataclasses.replace(plan, tensor_parallel_size=self.tp.size)
        self.plan = agree_on_plan(plan, self.tp)  # before any cache memory is allocated
        _check_runnable(self.plan)
        self._fit_max_model_len()
        self.model = self._load_weights(meta_model, folder)
        self._log_ops()
        return ModelRunner(
            self.model,
            self.plan,
            self.scheduler_config.max_num_seqs,
            self.device,
            driver=self.tp.rank == 0,
            max_capture_size=self._capture_size(),
            num_scratch_rows=self._num_scratch_rows(),
            num_scratch_positions=self._num_scratch_positions(),
        )

    def _resolve_speculation(
        self, model: str, tp_size: int, family: HFConfig
    ) -> SpeculativeConfig | None:
        spec = self.scheduler_config.speculative_config
        if spec is None:
            return None
        if spec.method == "mtp" and spec.draft_sample_method != "greedy":
            raise ValueError(
                f"speculative_config: draft_sample_method {spec.draft_sample_method!r} is not "
                "supported yet; allowed: 'greedy' (MTP drafts are the argmax)"
            )
        mtp_layers = int(getattr(family, "num_mtp_layers", 0) or 0)
        return spec.for_target(model, tp_size, mtp_layers, max_model_len=self.max_model_len)

    def _capturable(self, size: int, tokens_each: int) -> bool:
        """Whether a step of `size` chunks of `tokens_each` tokens runs captured (the
        scheduler pads verify steps to one shape only then)."""
        graphs = getattr(self.runner, "graphs", None)  # (none under tensor parallelism)
        return graphs is not None and graphs.may_capture(size, tokens_each)

    def _drafting_rows(self) -> int:
        """Speculative decoding: requests that may carry drafts in one step."""
        spec = self.speculative_config
        return 0 if spec is None else spec.max_drafting_batch(self.scheduler_config.max_num_seqs)

    def _num_scratch_rows(self) -> int:
        """Speculative decoding on a model with state groups: requests that may carry drafts
        in one step (each has a scratch row for its states; the plan may have given fewer than
        `_drafting_rows` to keep the scratch within its share of the budget)."""
        return self.plan.scratch_rows if self.plan.state_groups else 0

    def _num_scratch_positions(self) -> int:
        """States kept per scratch row when every state group's ops keep per-position states
        (k: a verify chunk has at most k + 1 tokens, the last one's state is in the page);
        0: rejections rewind instead."""
        spec = self.speculative_config
        if spec is None or not self._num_scratch_rows() or not keeps_positions(self.plan):
            return 0
        assert spec.num_speculative_tokens is not None
        return spec.num_speculative_tokens

    def _mtp_placeholders(self, req: Request, max_drafts: int) -> tuple[int, ...] | None:
        """The scheduler's drafter under method "mtp": the runner's MTP layers make the drafts
        in the step itself (`MtpDrafter`), from the pairs the request's last chunk left; the
        chunk carries placeholders (its last token repeated) until then. None (no drafts):
        nothing pending that ends at the chunk's last known token."""
        pending = req.mtp_pending
        last_known = req.num_tokens - 1
        if pending is None or pending[0] + len(pending[1]) != last_known:
            return None
        return (req.all_token_ids[-1],) * max_drafts

    def _drafts(self, req: Request, max_drafts: int) -> list[int]:
        """The scheduler's drafter: n-gram drafts (every request may carry some: verify.py)."""
        assert self.proposer is not None
        return self.proposer.propose(req.request_id, req.all_token_ids, max_drafts)

    def _capture_size(self) -> int:
        """Decode steps up to this batch size are captured (CPU, one process, not eager)."""
        cfg = self.model_config
        if cfg.enforce_eager or self.device.type != "cpu" or self.tp.size > 1:
            return 0
        return cfg.max_capture_size

    def _serve_as_worker(self, runner: ModelRunner) -> None:
        """Ranks 1..N-1: run the steps rank 0 broadcasts until it stops, then end the process
        (a torchrun launch's other ranks never run the command that built the engine)."""
        assert self.group is not None
        import torch.distributed as dist

        code = 0
        try:
            serve_steps(runner, self.group)
        except Exception as exc:
            logger.error("tensor-parallel rank %d stops: %r", self.tp.rank, exc)
            code = 1
        if code == 0:
            dist.destroy_process_group()  # before exit: no gloo thread left running
        # Nothing of this process outlives it, so skip the interpreter's teardown (0.6 s of
        # torch's module clean-up on a 2-core machine, during which rank 0's shutdown waits);
        # the log and the standard streams are flushed first.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for a single process)."""
        if isinstance(self.runner, DriverRunner):
            self.runner.shutdown()

    def _fit_max_model_len(self) -> None:
        """A pool that cannot hold one request of max_model_len lowers max_model_len to what
        it holds (a warning), so that no request is accepted that could never finish; a pool
        that cannot hold even a short request is a one-line error."""
        chunk = self.scheduler_config.max_num_batched_tokens
        fits = self.plan.max_request_tokens(chunk)
        if fits >= self.max_model_len:
            return
        if fits < min(self.max_model_len, MIN_REQUEST_TOKENS):
            raise ValueError(
                f"the cache pool ({self.plan.num_pages} pages of {self.plan.page_tokens} tokens) "
                f"cannot hold even a {MIN_REQUEST_TOKENS}-token request; give more memory_bytes "
                "or num_pages"
            )
        logger.warning(
            "the cache pool (%d pages) holds at most %d tokens of one request: max_model_len "
            "lowered from %d to %d (give more memory_bytes or num_pages to keep it)",
            self.plan.num_pages, fits, self.max_model_len, fits,
        )  # fmt: skip
        self.max_model_len = fits
        self.plan = dataclasses.replace(self.plan, max_model_len=fits)
        self.scheduler_config = dataclasses.replace(self.scheduler_config, max_model_len=fits)

    def _load_weights(self, model: CausalLM, folder: Path) -> CausalLM:
        model.materialise(self.device, torch_dtype(self.dtype))
        # tensor parallel: each rank reads only its slices of the safetensors files
        # (families that restack tensors while loading get them whole, and slice them)
        lazy = self.tp.size > 1 and type(model).load_weights is CausalLM.load_weights
        model.load_weights(iter_weights(folder, lazy=lazy))
        # int8: each rank quantizes its own shard, before the float linears left are packed
        self.quantization: QuantizationReport | None = None
        method = self.model_config.quantization
        if method is not None:
            self.quantization = quantize_model(model, self.tp, method=method)
        if self.device.type == "cpu" and self.model_config.prepack:
            prepack_linears(model)
        return model.eval()

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        extra_keys: tuple = (),
        stream: bool = False,
        after: str | None = None,
    ) -> Request:
        """Add a request. `after`: the id of a request whose prompt is the same; this one
        waits until that prompt is computed and then takes it from the prefix cache (the
        other choices of an n > 1 request share one prefill)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: an engine request is one sequence; LLM.generate runs n choices "
                "(or add n requests, each with n=1)"
            )
        ids, text = self._prompt_ids(prompt)
        self._check_stop_strings(params)
        self._check_logit_bias(params)
        matcher = self._matcher(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id, ids, params, self.eos_token_ids, extra_keys, prompt_text=text, stream=stream
        )
        req.matcher = matcher
        self.requests[request_id] = req
        if after is not None and after in self.requests:
            self._held.setdefault(after, []).append(req)
        else:
            self.scheduler.add_request(req)
        return req

    def _check_logit_bias(self, params: SamplingParams) -> None:
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad[:3]}"
            )

    @property
    def grammars(self) -> Any:
        """The structured-outputs grammar compiler (hybridkv.structured), made on first use;
        its compile() is cached and may be called from other threads."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError(
                    f"{self._no_tokenizer()}, so structured outputs (which need its vocabulary) "
                    "are not available"
                )
            from hybridkv.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _matcher(self, params: SamplingParams) -> Any:
        """A new grammar matcher for a request with structured outputs (else None)."""
        if params.structured is None:
            return None
        return self.grammars.compile(params.structured).matcher()

    def _no_tokenizer(self) -> str:
        return f"this model has no tokenizer (no tokenizer.json in {self.model_config.folder})"

    def _check_stop_strings(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"{self._no_tokenizer()}, so stop strings cannot be matched: "
                "use stop_token_ids instead"
            )

    def _prompt_ids(
        self, prompt: str | list[int], add_special_tokens: bool = True
    ) -> tuple[list[int], str | None]:
        """(token ids, text) of a prompt. `add_special_tokens=False` for a rendered chat prompt:
        its template writes the BOS itself, and the tokenizer's post-processor would add
        another (Llama 3, Gemma 3: a doubled BOS changes the answers)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self._no_tokenizer()}: give prompts as lists of token ids")
            if not prompt:
                raise ValueError("prompt is empty; give at least one character")
            check_unicode(prompt, "prompt")
            # A prompt so long that it exceeds max_model_len even at MAX_CHARS_PER_TOKEN
            # characters per token is refused before it is tokenized (megabytes take seconds).
            if len(prompt) > self.max_model_len * MAX_CHARS_PER_TOKEN:
                raise ValueError(
                    f"prompt has {len(prompt)} characters, far more than max_model_len="
                    f"{self.max_model_len} tokens hold"
                )
            ids, text = self.tokenizer.encode(prompt, add_special_tokens), prompt
        elif isinstance(prompt, list | tuple):
            ids, text = list(prompt), None
            bad = [
                t
                for t in ids
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise ValueError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:3]}"
                )
        else:
            raise ValueError(
                f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is "
                f"{self.max_model_len}, so at most {self.max_model_len - 1} fit"
            )
        return ids, text

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for held in self._held.values():
            if req in held:  # never reached the scheduler
                held.remove(req)
                req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
                return
        self.scheduler.abort(req)
        self.runner.release([request_id])

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or any(self._held.values())

    # -- step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that finished, and for streaming
        requests (`add_request(..., stream=True)`) every step they advanced.

        What fails fails alone: an error in one request's own work (stop strings, text,
        output) finishes that request with `RequestOutput.error`; an error in the batch's
        forward or sampling finishes the requests of that step (their states may be half
        written); the pool stays consistent and every other request goes on."""
        if self.cpu_share is not None:
            self.cpu_share.tick()
        self._release_held()
        started = time.perf_counter()
        out = self.scheduler.schedule()
        # the step's live requests (one aborted while the step ran is gone)
        stepped = [r for c in out.chunks if (r := self.requests.get(c.request_id)) is not None]
        masks = self._start_masks(out)  # grammar masks, filled while the forward runs
        try:
            result = self.runner.execute(out)
            if result.drafts:  # MTP drafts, made in the step: verified in place of placeholders
                out = with_drafts(out, result.drafts)
            samples, verified = self._sample(result, masks, out)
        except TensorParallelError:
            raise  # a rank died or hung: fatal, not one step's failure
        except Exception as exc:
            self.runner.release(out.preempted, finished=False)
            return self._fail(stepped, f"the step running this request failed: {exc!r}")
        now = time.monotonic()
        self._record_prompt_logprobs(result)
        failed: list[Request] = []
        for req in stepped:
            sample = samples.get(req.request_id)
            if sample is not None:
                self._record_sample(req, sample, now, failed)
            elif req.request_id in verified.tokens:
                self._record_verified(req, verified, now, failed)
        new_tokens: dict[str, int | list[int]] = {rid: s.token for rid, s in samples.items()}
        new_tokens.update(verified.tokens)
        finished = self.scheduler.update(out, new_tokens)
        self.scheduler.observe_step(out, time.perf_counter() - started)  # (adaptive_k)
        sampled = [r for r in stepped if r.request_id in new_tokens and r not in failed]
        finished += self._finish_grammars(sampled)
        finished += self._apply_stop_strings(sampled, failed)
        rejected = self.scheduler.drain_rejected()
        self.runner.release([r.request_id for r in finished + rejected])
        if self.proposer is not None:
            for req in finished + rejected:
                self.proposer.discard(req.request_id)
        outputs = []
        for req in sampled:
            if req.is_finished or req.stream:
                output = self._safe_output(req, failed)
                if output is not None:
                    outputs.append(output)
        outputs += [self._output(r) for r in rejected] + self._fail(failed, None)
        for req in finished + rejected:
            self.requests.pop(req.request_id, None)
        return outputs

    def _safe_output(self, req: Request, failed: list[Request]) -> RequestOutput | None:
        try:
            return self._output(req)
        except Exception as exc:  # e.g. a token id its tokenizer cannot decode
            req.error = f"this request's output could not be built: {exc!r}"
            failed.append(req)
            return None

    def _fail(self, requests: list[Request], error: str | None) -> list[RequestOutput]:
        """Finish requests the engine gave up on; their pages return to the pool."""
        outputs = []
        for req in requests:
            if error is not None:
                req.error = error
            if not req.is_finished:
                self.scheduler.finish_requests([req], "abort")
            self.runner.release([req.request_id])
            self.requests.pop(req.request_id, None)
            outputs.append(self._error_output(req))
        return outputs

    def _error_output(self, req: Request) -> RequestOutput:
        completion = CompletionOutput(0, "", list(req.output_token_ids), "abort")
        return RequestOutput(
            req.request_id,
            req.prompt_text,
            list(req.prompt_token_ids),
            [completion],
            True,
            req.num_cached_tokens,
            {"arrival_time": req.arrival_time},
            req.error,
        )

    # -- sampling ------------------------------------------------------------------------------

    def _sample(
        self, result: StepLogits, masks: Future | None, out: SchedulerOutput
    ) -> tuple[dict[str, Sample], Verified]:
        """Sample a token for every request of the step that samples (the engine owns their
        sampling state: generators, the tokens the penalties count, grammar matchers), and
        verify the drafts of those that carried some: (samples, verified tokens)."""
        bitmask = masks.result() if masks is not None else None  # (before any early return)
        if result.logits is None or not result.request_ids:
            return {}, NOTHING_VERIFIED
        rows = [self._sampling_row(self.requests.get(rid)) for rid in result.request_ids]
        if not result.num_rows:
            samples = self.sampler(result.logits, rows, bitmask)
            return dict(zip(result.request_ids, samples, strict=True)), NOTHING_VERIFIED
        return self._sample_and_verify(result, rows, out, bitmask)

    def _sample_and_verify(
        self,
        result: StepLogits,
        rows: list[SamplingRow],
        out: SchedulerOutput,
        bitmask: torch.Tensor | None,
    ) -> tuple[dict[str, Sample], Verified]:
        """A step with drafts: requests with one logits row sample as usual (grammar rows
        among them: their mask rows are theirs in request order), the others verify their
        drafts (`hybridkv.spec_decode.verify.verify_step`)."""
        assert result.logits is not None
        drafts = {c.request_id: c.token_ids[c.num_known :] for c in out.chunks if c.num_drafts}
        first = [0]
        for n in result.num_rows:
            first.append(first[-1] + n)
        plain = [i for i, rid in enumerate(result.request_ids) if rid not in drafts]
        samples: dict[str, Sample] = {}
        if plain:
            logits = result.logits[[first[i] for i in plain]]
            masks = None if bitmask is None else bitmask[plain]
            picked = self.sampler(logits, [rows[i] for i in plain], masks)
            samples = {result.request_ids[i]: s for i, s in zip(plain, picked, strict=True)}
        drafting = {rid: (i, rows[i]) for i, rid in enumerate(result.request_ids) if rid in drafts}
        verified = verify_step(result.logits, first, drafting, drafts, self.sampler)
        proposed = {c.request_id: self.scheduler.proposed_drafts(c) for c in out.chunks}
        for rid, tokens in verified.tokens.items():
            # the proposer's drafts only (fillers, its last token repeated, are not drafts)
            real = proposed.get(rid, len(drafts[rid]))
            self.spec_stats.observe(real, min(len(tokens) - 1, real))
        return samples, verified

    def _start_masks(self, out: SchedulerOutput) -> Future | None:
        """Fill the grammar masks of the step's sampling rows in the mask thread, so that
        they are ready when the logits are (llguidance drops the GIL; the rows are the
        runner's `StepLogits.request_ids`, in chunk order). None: no row has a grammar."""
        ids = [c.request_id for c in out.chunks if c.sampling is not None]
        drafted = {c.request_id for c in out.chunks if c.num_drafts}  # masked when verified
        reqs = [None if rid in drafted else self.requests.get(rid) for rid in ids]
        rows = [i for i, r in enumerate(reqs) if r is not None and r.matcher is not None]
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-masks")
        matchers = [reqs[i].matcher for i in rows]  # type: ignore[union-attr]
        return self._mask_thread.submit(fill_bitmasks, matchers, rows, len(ids), self.vocab_size)

    def _sampling_row(self, req: Request | None) -> SamplingRow:
        if req is None:  # aborted while the step ran: its token is dropped
            return SamplingRow(GREEDY)
        params = req.sampling_params
        if params.seed is not None and req.generator is None:
            req.generator = torch.Generator().manual_seed(params.seed)
        penalised = params.has_penalties
        return SamplingRow(
            params,
            req.generator,
            req.output_token_ids if penalised else (),
            req.prompt_token_ids if params.repetition_penalty != 1.0 else (),
            req.matcher,
        )

    def _record_sample(self, req: Request, sample: Sample, now: float, failed: list) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_times.append(now)
        if req.sampling_params.logprobs is not None:
            entry = dict(sample.top_logprobs or {})
            entry[sample.token] = sample.logprob
            req.logprobs.append(entry)
        if req.matcher is not None and not req.matcher.accept_token(sample.token):
            req.error = f"the grammar of this request rejected token {sample.token}"
            failed.append(req)

    def _record_verified(
        self, req: Request, verified: Verified, now: float, failed: list
    ) -> None:
        """A request's verified tokens: times, log-probs, and its grammar advanced through them
        (verification only chose tokens its masks allowed)."""
        tokens = verified.tokens[req.request_id]
        req.first_token_time = req.first_token_time or now
        req.token_times += [now] * len(tokens)
        req.logprobs += verified.logprobs.get(req.request_id, [])
        if req.matcher is not None:
            for token in tokens:
                if not req.matcher.accept_token(token):
                    req.error = f"the grammar of this request rejected token {token}"
                    failed.append(req)
                    return

    def _finish_grammars(self, sampled: list[Request]) -> list[Request]:
        """Requests whose grammar is complete stop (also with ignore_eos or min_tokens: no
        token could follow)."""
        done = [
            r
            for r in sampled
            if r.matcher is not None and not r.is_finished and r.matcher.is_terminated()
        ]
        self.scheduler.finish_requests(done, "stop")
        return done

    def _record_prompt_logprobs(self, result: StepLogits) -> None:
        """Append each chunk's prompt log-probs (a chunk recomputed after a preemption adds
        only the positions not recorded yet)."""
        for rid, part in result.prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            have = len(req.prompt_logprobs)  # entries for prompt tokens 1 .. have
            skip = have - part.start
            if skip < 0:
                continue  # not contiguous (cannot happen: chunks run in order)
            targets = req.prompt_token_ids[part.start + 1 :]
            for k in range(skip, len(part.token_logprobs)):
                entry = dict(part.top[k])
                entry[targets[k]] = part.token_logprobs[k]
                req.prompt_logprobs.append(entry)

    # -- held requests (n > 1: the other choices wait for the first one's prompt) ------------

    def _release_held(self) -> None:
        """Requests held behind another (`add_request(..., after=...)`) enter the scheduler
        once its prompt is computed (and in the prefix cache) or it is gone."""
        for parent_id in list(self._held):
            parent = self.requests.get(parent_id)
            if parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens:
                continue
            for req in self._held.pop(parent_id):
                if req.request_id in self.requests:
                    self.scheduler.add_request(req)

    def _text(self, req: Request) -> str:
        """The output text so far. While a request with stop strings still runs, the last
        (longest stop - 1) characters are held back: they may be the start of a stop string
        that the next tokens complete, and a stream must never show it. Without a tokenizer
        (token-id mode) the text is empty."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(req.output_token_ids)
        stops = req.sampling_params.stop
        if stops and not req.is_finished and not req.sampling_params.include_stop_str_in_output:
            text = text[: max(0, len(text) - max(len(s) for s in stops) + 1)]
        return text

    def _apply_stop_strings(self, requests: list[Request], failed: list[Request]) -> list[Request]:
        stopped = []
        for req in requests:
            stops = req.sampling_params.stop
            if req.is_finished or not stops or self.tokenizer is None:
                continue
            try:
                text = self.tokenizer.decode(req.output_token_ids)
            except Exception as exc:
                req.error = f"this request's output could not be decoded: {exc!r}"
                failed.append(req)
                continue
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                pos, stop = min(hits)
                keep = pos + len(stop) if req.sampling_params.include_stop_str_in_output else pos
                req.stop_text = text[:keep]
                req.stop_reason = stop
                self.scheduler.finish_requests([req], "stop")
                stopped.append(req)
        return stopped

    def _output(self, req: Request) -> RequestOutput:
        text = req.stop_text if req.stop_text is not None else self._text(req)
        logprobs = list(req.logprobs) if req.sampling_params.logprobs is not None else None
        cumulative = (
            sum(e[t] for e, t in zip(logprobs, req.output_token_ids, strict=False))
            if logprobs
            else None
        )
        completion = CompletionOutput(
            0,
            text,
            list(req.output_token_ids),
            req.finish_reason,
            req.stop_reason,
            logprobs,
            cumulative,
        )
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
            metrics["last_token_time"] = req.token_times[-1]
        return RequestOutput(
            req.request_id,
            req.prompt_text,
            list(req.prompt_token_ids),
            [completion],
            req.is_finished,
            req.num_cached_tokens,
            metrics,
            req.error,
            self._prompt_logprobs_of(req),
        )

    @staticmethod
    def _prompt_logprobs_of(req: Request) -> list[dict[int, float] | None] | None:
        if req.sampling_params.prompt_logprobs is None:
            return None
        if len(req.prompt_logprobs) < req.num_prompt_tokens - 1:
            return None  # not all computed yet (a streaming output during prefill)
        return [None, *req.prompt_logprobs]
