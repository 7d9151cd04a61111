"""The engine: model + memory plan + cache manager + scheduler + runner, one step at a time.

    engine = Engine(model="path/to/checkpoint", dtype="float32")
    req = engine.add_request("def fib(n):", SamplingParams(max_tokens=32))
    while engine.has_unfinished:
        for update in engine.step(): ...      # RequestOutput of every request that advanced

Requests are validated before they enter the engine (a ValueError names the bad value);
nothing about a rejected request touches the cache or the other requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.config import CacheConfig, SchedulerConfig, split_kwargs
from hybridkv.core.coordinator import CacheManager
from hybridkv.core.request import Request
from hybridkv.core.scheduler import Scheduler
from hybridkv.dtypes import canonical_dtype, torch_dtype
from hybridkv.kv.plan import MemoryPlan, plan_for_config
from hybridkv.kv.presets import load_model_config
from hybridkv.kv.specs import architecture_of, read_layers, resolve_cache_dtypes, text_config
from hybridkv.layers.linear import prepack_linears
from hybridkv.models.loader import eos_token_ids, generation_config, iter_weights
from hybridkv.models.registry import model_class
from hybridkv.outputs import CompletionOutput, RequestOutput
from hybridkv.sampling_params import SamplingParams
from hybridkv.tokenizer import load_tokenizer
from hybridkv.worker.host_memory import keep_freed_memory
from hybridkv.worker.model_runner import ModelRunner

DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"
AUTO_BUDGET_BYTES = 4 * 2**30


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how.

    - `model`: a folder with config.json, safetensors and tokenizer.json (None: the built-in
      default model). Without tokenizer.json it runs in token-id mode: prompts are lists of
      token ids, outputs have token ids and empty text, and stop strings are refused.
    - `dtype`: "auto" (the checkpoint's dtype), "float32" or "bfloat16".
    - `device`: "auto" (CUDA if available, else CPU), "cpu" or "cuda".
    - `prepack`: CPU: oneDNN pre-packed linear weights (`hybridkv.layers.linear`).
    - `compile`: torch.compile the fused Mamba2 decode step (slow first step); used where the
      native CPU kernels (`hybridkv.ops.native`) are not: no C compiler, or a bf16 state.
    - `keep_freed_memory`: CPU on glibc: reuse large freed blocks instead of returning them to
      the OS after every step (`hybridkv.worker.host_memory`; process-wide).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    prepack: bool = True
    compile: bool = False
    keep_freed_memory: bool = True

    def __post_init__(self) -> None:
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

    @property
    def folder(self) -> Path:
        return Path(self.model).expanduser() if self.model else DEFAULT_MODEL


def _compile_decode_steps(model: torch.nn.Module) -> None:
    """Give every Mamba2 mixer one shared compiled fused decode step (compiled on first use)."""
    from hybridkv.layers.mamba2 import Mamba2Mixer
    from hybridkv.ops.mamba2 import decode_in_place

    step = torch.compile(decode_in_place, dynamic=True)
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            module.use_compiled_decode(step)


class Engine:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        mkw, ckw, skw = split_kwargs(kwargs, ModelConfig, CacheConfig, SchedulerConfig)
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
        self.device = self._device()
        if self.device.type == "cpu" and self.model_config.keep_freed_memory:
            keep_freed_memory()
        self.dtype = self._dtype(hf_config)
        self.tokenizer = load_tokenizer(folder)  # None: token-id mode (no tokenizer.json)
        runtime_config = {**hf_config, "torch_dtype": self.dtype, "dtype": self.dtype}
        self.max_model_len = int(
            skw.get("max_model_len") or text_config(hf_config).get("max_position_embeddings", 4096)
        )
        self.scheduler_config = SchedulerConfig(**{**skw, "max_model_len": self.max_model_len})
        self.cache_config = CacheConfig(**ckw)
        self.plan = self._plan(runtime_config)
        self.model = self._load_model(cls, folder, hf_config, runtime_config)
        self.cache = CacheManager(self.plan, self.cache_config)
        self.scheduler = Scheduler(self.cache, self.scheduler_config)
        self.runner = ModelRunner(
            self.model,
            self.plan,
            self.cache,
            self.scheduler_config.max_num_seqs,
            self.device,
            self.model_config.seed,
        )
        self.eos_token_ids = eos_token_ids(text_config(hf_config), generation_config(folder))
        self.vocab_size = int(text_config(hf_config)["vocab_size"])
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # -- set-up --------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        want = self.model_config.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but no CUDA device is available")
        return torch.device(want)

    def _dtype(self, hf_config: dict[str, Any]) -> str:
        if self.model_config.dtype != "auto":
            return canonical_dtype(self.model_config.dtype)
        from hybridkv.kv.specs import model_dtype

        return model_dtype(hf_config)

    def _plan(self, runtime_config: dict[str, Any]) -> MemoryPlan:
        """Plan the cache. Without a budget, size it for max_num_seqs requests of
        max_model_len tokens, capped at 4 GiB."""
        cache = self.cache_config
        if cache.platform == "cpu" and self.device.type == "cuda":
            cache = dataclasses.replace(cache, platform="cuda")
            self.cache_config = cache
        if cache.memory_bytes is not None or cache.num_pages is not None:
            return plan_for_config(runtime_config, cache, self.max_model_len)
        probe = plan_for_config(
            runtime_config, dataclasses.replace(cache, num_pages=10**6), self.max_model_len
        )
        per_request = len(probe.state_groups) * 2 + sum(
            math.ceil(self.max_model_len / g.page_tokens) for g in probe.attention_groups
        )  # running + snapshot state pages, attention pages for max_model_len
        cap = AUTO_BUDGET_BYTES // (probe.page_bytes * probe.layers_per_group)
        wanted = per_request * self.scheduler_config.max_num_seqs + 1
        if cap < per_request + 1:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {per_request + 1} pages "
                f"but 4 GiB hold {cap}; lower max_model_len or give memory_bytes"
            )
        return plan_for_config(
            runtime_config,
            dataclasses.replace(cache, num_pages=min(wanted, cap)),
            self.max_model_len,
        )

    def _load_model(self, cls, folder: Path, hf_config, runtime_config) -> torch.nn.Module:
        cfg = text_config(hf_config)
        dtypes = resolve_cache_dtypes(runtime_config)
        with torch.device("meta"):
            probe = cls(cfg, read_layers(runtime_config, dtypes))
        del probe  # constructing on meta first catches config errors before allocating memory
        model = cls(cfg, read_layers(runtime_config, dtypes))
        model = model.to(device=self.device, dtype=torch_dtype(self.dtype))
        model.load_weights(iter_weights(folder))
        if self.device.type == "cpu" and self.model_config.prepack:
            prepack_linears(model)
        if self.model_config.compile:
            _compile_decode_steps(model)
        return model.eval()

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        extra_keys: tuple = (),
        stream: bool = False,
    ) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        ids, text = self._prompt_ids(prompt)
        self._check_stop_strings(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id, ids, params, self.eos_token_ids, extra_keys, prompt_text=text, stream=stream
        )
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return req

    def _no_tokenizer(self) -> str:
        return f"this model has no tokenizer (no tokenizer.json in {self.model_config.folder})"

    def _check_stop_strings(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"{self._no_tokenizer()}, so stop strings cannot be matched: "
                "use stop_token_ids instead"
            )

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self._no_tokenizer()}: give prompts as lists of token ids")
            if not prompt:
                raise ValueError("prompt is empty; give at least one character")
            ids, text = self.tokenizer.encode(prompt), prompt
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
        self.scheduler.abort(req)
        self.runner.release([req])

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that finished, and for streaming
        requests (`add_request(..., stream=True)`) every step they advanced."""
        out = self.scheduler.schedule()
        samples = self.runner.execute(out)
        now = time.monotonic()
        for chunk in out.chunks:
            sample = samples.get(chunk.request.request_id)
            if sample is not None:
                self._record_sample(chunk.request, sample, now)
        finished = self.scheduler.update(out, {rid: s.token for rid, s in samples.items()})
        finished += self._apply_stop_strings([c.request for c in out.chunks if c.samples])
        rejected = self.scheduler.drain_rejected()
        self.runner.release(finished + rejected)
        outputs = [
            self._output(c.request)
            for c in out.chunks
            if c.samples and (c.request.is_finished or c.request.stream)
        ]
        outputs += [self._output(r) for r in rejected]
        for req in finished + rejected:
            self.requests.pop(req.request_id, None)
        return outputs

    def _record_sample(self, req: Request, sample, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_times.append(now)
        if req.sampling_params.logprobs is not None:
            entry = dict(sample.top_logprobs or {})
            entry[sample.token] = sample.logprob
            req.logprobs.append(entry)

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

    def _apply_stop_strings(self, requests: list[Request]) -> list[Request]:
        stopped = []
        for req in requests:
            stops = req.sampling_params.stop
            if req.is_finished or not stops or self.tokenizer is None:
                continue
            text = self.tokenizer.decode(req.output_token_ids)
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
        )
