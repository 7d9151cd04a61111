"""`speculative_config`: what to draft and how many tokens, spelled as vLLM spells it.

The `LLM(speculative_config=...)` keyword and `--speculative-config '<json>'` on `generate`,
`serve` and `bench` take the same object vLLM takes:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}
    {"method": "mtp", "num_speculative_tokens": 2}

Every key vLLM has defined (its current `SpeculativeConfig` and the V0 engine's keys) is either
honoured or refused with a one-line ValueError naming the key and what it allows; a key vLLM
never had is refused naming the keys hybridkv honours. Honoured:

    method                  "ngram" (prompt lookup; aliases "[ngram]", "ngram_gpu") or "mtp"
                            (the checkpoint's multi-token-prediction layers; aliases: vLLM's
                            per-family names such as "qwen3_next_mtp", "deepseek_mtp")
    model                   ngram: None, "ngram" or "[ngram]" (names the method when `method` is
                            absent, as in vLLM); mtp: None or the target model itself
    num_speculative_tokens  k, 1..MAX_SPECULATIVE_TOKENS; ngram: required; mtp: default the
                            checkpoint's MTP layer count, a larger k a multiple of it (vLLM's rule)
    prompt_lookup_max/min   ngram only: the longest / shortest suffix n-gram matched (vLLM: both
                            absent -> 5 and 5; one given -> the other takes its value; min <= max)
    disable_by_batch_size   no drafts in a step with at least this many running requests (>= 2)
    num_speculative_tokens_per_batch_size  vLLM's dynamic-k schedule: [[lo, hi, k], ...], k drafts
                            in a step with lo..hi running requests (ranges sorted, disjoint, the
                            first from 1; a gap or a batch past the last range takes the k of
                            the range before; 0 <= k <= num_speculative_tokens)
    max_model_len           no drafts for a request once length + k reaches this
    draft_tensor_parallel_size  mtp: None or the target's size (the MTP layers are sharded like
                            the target's); ngram: any (there is no draft model)
    draft_sample_method     "greedy" (drafts are argmax: a point mass in rejection sampling) or,
                            mtp only, "probabilistic" (parsed; the engine refuses it until
                            drafts sampled from the MTP distribution q are built)

hybridkv's own key (vLLM has no such key):

    adaptive_k              true: each step picks how many drafts its verify chunks carry
                            (0..the caps above) for the most tokens per second, from the step
                            times it measured and the acceptance seen per draft position
                            (`hybridkv.spec_decode.adaptive`); default false (k every step)

Keys that ask for something hybridkv does not do (EAGLE, draft models, suffix trees, typical
acceptance, ...) are accepted only at vLLM's own default value, so a config written for vLLM
with its defaults spelled out still parses.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, NoReturn

METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64  # n-gram length cap: the proposer indexes every n in [min, max]
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither bound is given
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'

NGRAM_ALIASES = frozenset({"ngram", "[ngram]", "ngram_gpu"})
# vLLM's per-family MTP method names (deprecated there in favour of "mtp")
MTP_ALIASES = frozenset(
    {
        "mtp", "deepseek_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "mimo_mtp", "mimo_v2_mtp",
        "glm4_moe_mtp", "glm4_moe_lite_mtp", "ernie_mtp", "nemotron_h_mtp", "longcat_flash_mtp",
        "exaone_moe_mtp", "bailing_hybrid_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp",
    }
)  # fmt: skip
# vLLM methods hybridkv does not run (refused by name)
UNSUPPORTED_METHODS = frozenset(
    {
        "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class",
        "dflash", "dspark", "extract_hidden_states",
    }
)  # fmt: skip

HONOURED_KEYS = (
    "method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "disable_by_batch_size", "max_model_len", "draft_tensor_parallel_size",
    "draft_sample_method", "num_speculative_tokens_per_batch_size", "adaptive_k",
)  # fmt: skip

_DRAFT_MODEL = "there is no separate draft model (ngram copies, mtp uses the target's layers)"
_EAGLE = "an EAGLE option; hybridkv speculates with 'ngram' or 'mtp'"
_SUFFIX = "a suffix-decoding option; method 'suffix' is not supported"
_ENGINE = "set by the engine, not in speculative_config"

# vLLM keys hybridkv accepts only at the listed values (vLLM's defaults, or values that mean
# what hybridkv does anyway), with the reason any other value is refused.
DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "enforce_eager": ((None, True), "drafts always run eagerly in hybridkv"),
    "quantization": ((None,), "the MTP layers load with the target's quantization"),
    "moe_backend": ((None,), "the MTP layers run the target's kernels"),
    "attention_backend": ((None, "auto"), "the MTP layers run the target's attention backend"),
    "kv_cache_dtype": ((None, "auto"), "the MTP layers' cache uses the target's kv_cache_dtype"),
    "revision": ((None,), _DRAFT_MODEL),
    "code_revision": ((None,), _DRAFT_MODEL),
    "draft_load_config": ((None,), _DRAFT_MODEL),
    "use_heterogeneous_vocab": ((False,), _DRAFT_MODEL),
    "index_share_for_mtp_iteration": ((None,), "sparse-index sharing (DeepSeek-V3.2) only"),
    "tensor_parallel_size": ((None,), "pass draft_tensor_parallel_size instead (as in vLLM)"),
    "disable_padded_drafter_batch": ((False,), _EAGLE),
    "disable_eagle_block_drop": ((False,), _EAGLE),
    "use_local_argmax_reduction": ((False,), "vocab-parallel draft argmax is not supported"),
    "parallel_drafting": ((False,), "parallel drafting is not supported"),
    "enable_adaptive_verification": ((False,), "a DSpark option; not supported"),
    "dspark_draft_topk": ((None,), "a DSpark option; not supported"),
    "rejection_sample_method": (("standard",), "only 'standard' rejection sampling"),
    "synthetic_acceptance_rates": ((None,), "synthetic acceptance is not supported"),
    "synthetic_acceptance_length": ((None,), "synthetic acceptance is not supported"),
    "suffix_decoding_max_tree_depth": ((24,), _SUFFIX),
    "suffix_decoding_max_cached_requests": ((10000,), _SUFFIX),
    "suffix_decoding_max_spec_factor": ((1.0,), _SUFFIX),
    "suffix_decoding_min_token_prob": ((0.1,), _SUFFIX),
    "target_model_config": ((None,), _ENGINE),
    "target_parallel_config": ((None,), _ENGINE),
    "draft_model_config": ((None,), _ENGINE),
    "draft_parallel_config": ((None,), _ENGINE),
    # the V0 engine's keys (vLLM <= 0.10)
    "acceptance_method": (
        ("rejection_sampler",),
        "only rejection sampling (typical acceptance changes the output distribution)",
    ),
    "posterior_threshold": ((None,), "a typical-acceptance option; not supported"),
    "posterior_alpha": ((None,), "a typical-acceptance option; not supported"),
    "disable_mqa_scorer": ((False,), "drafts are always scored in one multi-token pass"),
    "disable_logprobs": ((False,), "requested log-probs are always returned"),
    "speculative_token_tree": ((None,), "tree drafts are not supported"),
    "disable_log_stats": ((None,), _ENGINE),
    "enable_chunked_prefill": ((None,), _ENGINE),
}


def _fail(message: str) -> NoReturn:
    raise ValueError(f"speculative_config: {message}")


def _int_in(key: str, value: object, low: int, high: int | None = None) -> int:
    """An int (not a bool) in [low, high]; else a one-line error naming the key."""
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(f"{key} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        _fail(f"{key} must be {bound}, got {value}")
    return value


def _same(a: object, b: object) -> bool:
    """Value equality that keeps True and 1 apart (a flag must be a bool) but lets 1 equal 1.0
    (JSON writes a float default without its point)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _resolve_method(method: object, model: object) -> str:
    if method is None:
        if model in NGRAM_ALIASES:
            return "ngram"
        if model is None:
            _fail("needs a method: 'ngram' or 'mtp'")
        _fail(
            f"model {model!r} without a method asks for a draft model, which is not supported;"
            " use method 'ngram' or 'mtp'"
        )
    if not isinstance(method, str):
        _fail(f"method must be 'ngram' or 'mtp', got {method!r}")
    if method in NGRAM_ALIASES:
        return "ngram"
    if method in MTP_ALIASES:
        return "mtp"
    if method in UNSUPPORTED_METHODS:
        _fail(f"method {method!r} is not supported; allowed: 'ngram', 'mtp'")
    _fail(f"unknown method {method!r}; allowed: 'ngram', 'mtp'")


_SCHEDULE = "num_speculative_tokens_per_batch_size"


def _schedule(value: object) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM's dynamic-k schedule as parsed from JSON: a list of [lo, hi, k] entries -> sorted
    tuples (checked in full by `_check_schedule`)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        _fail(f"{_SCHEDULE} must be a non-empty list of [lo, hi, k] entries, got {value!r}")
    entries = []
    for entry in value:
        if isinstance(entry, list | tuple) and len(entry) == 5:
            _fail(
                f"{_SCHEDULE}: entry {list(entry)} has context-length bounds (5 items), which "
                "hybridkv does not support; use [lo, hi, k] entries"
            )
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            _fail(f"{_SCHEDULE}: each entry must be [lo, hi, k], got {entry!r}")
        for item in entry:
            if isinstance(item, bool) or not isinstance(item, int):
                _fail(f"{_SCHEDULE}: entry {list(entry)} must hold integers")
        entries.append((entry[0], entry[1], entry[2]))
    return tuple(sorted(entries))


def _check_schedule(schedule: tuple[tuple[int, int, int], ...], k: int | None) -> None:
    """vLLM's rules: positive batch ranges, lo <= hi, disjoint, the first from 1; k >= 0.
    hybridkv also refuses a k above num_speculative_tokens (vLLM clamps it silently)."""
    previous_hi = 0
    for lo, hi, n in schedule:
        where = f"{_SCHEDULE}: entry [{lo}, {hi}, {n}]"
        if lo < 1 or hi < lo:
            _fail(f"{where}: the batch-size range must have 1 <= lo <= hi")
        if lo <= previous_hi:
            _fail(f"{where} overlaps the range before it (ranges must be disjoint)")
        if n < 0 or (k is not None and n > k):
            top = "num_speculative_tokens" if k is None else f"num_speculative_tokens={k}"
            _fail(f"{where}: k must be in 0..{top}")
        previous_hi = hi
    if schedule[0][0] != 1:
        _fail(f"{_SCHEDULE}: the first range must start at batch size 1, got {schedule[0][0]}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed, validated `speculative_config` (the module docstring lists the keys).

    `num_speculative_tokens` is None only for "mtp" before `for_target` fills it from the
    checkpoint; the ngram bounds are set for "ngram" and None for "mtp"."""

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    max_model_len: int | None = None
    draft_tensor_parallel_size: int | None = None
    draft_sample_method: str = "greedy"
    model: str | None = None
    # vLLM's dynamic-k schedule, normalised: ((lo, hi, k), ...) sorted by lo
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    adaptive_k: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail(f"method must be 'ngram' or 'mtp', got {self.method!r}")
        k = self.num_speculative_tokens
        if k is not None:
            _int_in("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        elif self.method == "ngram":
            _fail(f"method 'ngram' needs num_speculative_tokens (1..{MAX_SPECULATIVE_TOKENS})")
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_mtp()
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 2)
        if self.max_model_len is not None:
            _int_in("max_model_len", self.max_model_len, 1)
        if self.draft_tensor_parallel_size is not None:
            _int_in("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            _fail(
                f"draft_sample_method must be 'greedy' or 'probabilistic', "
                f"got {self.draft_sample_method!r}"
            )
        if not isinstance(self.adaptive_k, bool):
            _fail(f"adaptive_k must be true or false, got {self.adaptive_k!r}")
        if self.num_speculative_tokens_per_batch_size is not None:
            _check_schedule(self.num_speculative_tokens_per_batch_size, k)

    def _check_ngram(self) -> None:
        hi, lo = self.prompt_lookup_max, self.prompt_lookup_min
        if hi is None or lo is None:
            _fail(
                "method 'ngram' needs prompt_lookup_max and prompt_lookup_min (from_dict "
                "fills them as vLLM does)"
            )
        _int_in("prompt_lookup_max", hi, 1, MAX_PROMPT_LOOKUP)
        _int_in("prompt_lookup_min", lo, 1, MAX_PROMPT_LOOKUP)
        if lo > hi:
            _fail(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        if self.model not in (None, "ngram", "[ngram]"):
            _fail(
                f"method 'ngram' takes no model (got {self.model!r}): it copies drafts from "
                "the request's own tokens"
            )
        if self.draft_sample_method != "greedy":
            _fail(
                "draft_sample_method 'probabilistic' needs method 'mtp' (ngram drafts are "
                "copied tokens, a point mass)"
            )

    def _check_mtp(self) -> None:
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, key) is not None:
                _fail(f"{key} is an ngram option; method 'mtp' does not take it")
        if self.model is not None and not isinstance(self.model, str):
            _fail(f"model must be None or the target model for method 'mtp', got {self.model!r}")

    # -- parsing -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> SpeculativeConfig:
        """Parse a `speculative_config` mapping as vLLM accepts it (module docstring)."""
        if not isinstance(config, Mapping):
            _fail(f"must be a mapping (a JSON object), got {type(config).__name__}")
        for key in config:
            if not isinstance(key, str):
                _fail(f"keys must be strings, got {key!r}")
            if key in HONOURED_KEYS:
                continue
            if key in DEFAULT_ONLY:
                allowed, why = DEFAULT_ONLY[key]
                value = config[key]
                if not any(_same(value, a) for a in allowed):
                    shown = " or ".join(json.dumps(a) for a in allowed)
                    _fail(
                        f"{key}={json.dumps(value, default=str)} is not supported ({why}); "
                        f"allowed: {shown}"
                    )
                continue
            close = difflib.get_close_matches(key, HONOURED_KEYS + tuple(DEFAULT_ONLY), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            _fail(f"unknown key {key!r}{hint}; valid keys: {', '.join(HONOURED_KEYS)}")
        method = _resolve_method(config.get("method"), config.get("model"))
        hi, lo = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
        if method == "ngram":
            # the given bounds are checked under their own names before one fills the other
            for key, value in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
                if value is not None:
                    _int_in(key, value, 1, MAX_PROMPT_LOOKUP)
            # vLLM's defaults: neither bound -> 5 and 5; one bound -> the other takes its value
            if hi is None and lo is None:
                hi = lo = DEFAULT_PROMPT_LOOKUP
            elif hi is None:
                hi = lo
            elif lo is None:
                lo = hi
        model = config.get("model")
        if method == "ngram" and model in NGRAM_ALIASES:
            model = None  # names the method, not a model
        return cls(
            method=method,
            num_speculative_tokens=config.get("num_speculative_tokens"),
            prompt_lookup_max=hi,
            prompt_lookup_min=lo,
            disable_by_batch_size=config.get("disable_by_batch_size"),
            max_model_len=config.get("max_model_len"),
            draft_tensor_parallel_size=config.get("draft_tensor_parallel_size"),
            draft_sample_method=config.get("draft_sample_method", "greedy"),
            model=model,
            num_speculative_tokens_per_batch_size=_schedule(config.get(_SCHEDULE)),
            adaptive_k=config.get("adaptive_k", False),
        )

    @classmethod
    def from_json(cls, text: str, source: str = "speculative_config") -> SpeculativeConfig:
        """A JSON object's text; `source` names it in errors."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{source} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                f"expected an object such as {EXAMPLE}"
            ) from None
        if not isinstance(value, dict):
            raise ValueError(
                f"{source} must be a JSON object such as {EXAMPLE}, got {type(value).__name__}"
            )
        return cls.from_dict(value)

    @classmethod
    def from_cli(cls, text: str) -> SpeculativeConfig:
        """`--speculative-config '<json object>'`."""
        return cls.from_json(text, "--speculative-config")

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | Mapping[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """The `LLM(speculative_config=...)` keyword: a config, a mapping, JSON text or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ValueError(
            f"speculative_config must be a dict, a JSON string or None, got {type(value).__name__}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The config as vLLM spells it (keys at None left out); `from_dict` reads it back."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out[_SCHEDULE] is not None:
            out[_SCHEDULE] = [list(entry) for entry in out[_SCHEDULE]]
        if not out["adaptive_k"]:
            del out["adaptive_k"]  # hybridkv's own key: absent at its default, as vLLM knows none
        return {k: v for k, v in out.items() if v is not None}

    # -- against the target model --------------------------------------------------------------

    def for_target(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        mtp_layers: int = 0,
        max_model_len: int | None = None,
    ) -> SpeculativeConfig:
        """Checks against the target model (its path or name, its tensor-parallel size, its
        multi-token-prediction layer count, its max_model_len); for "mtp" fills
        num_speculative_tokens from the layer count when it was not given."""
        spec = self
        limit = spec.max_model_len
        if max_model_len is not None and limit is not None and limit > max_model_len:
            _fail(f"max_model_len={limit} cannot exceed the model's max_model_len={max_model_len}")
        if spec.method == "ngram":
            return spec
        if mtp_layers < 1:
            _fail(
                f"method 'mtp' needs a checkpoint with multi-token-prediction layers; {model!r} "
                "has none (num_nextn_predict_layers / mtp_num_hidden_layers)"
            )
        if spec.model is not None and spec.model != model:
            _fail(
                f"method 'mtp' drafts with the target's own layers: model must be None or "
                f"{model!r}, got {spec.model!r}"
            )
        tp = spec.draft_tensor_parallel_size
        if tp is not None and tp != tensor_parallel_size:
            _fail(
                f"draft_tensor_parallel_size={tp} must equal tensor_parallel_size="
                f"{tensor_parallel_size} (the MTP layers are sharded like the target's)"
            )
        k = spec.num_speculative_tokens
        if k is None:
            k = min(mtp_layers, MAX_SPECULATIVE_TOKENS)
        elif k > mtp_layers and k % mtp_layers:
            _fail(
                f"num_speculative_tokens={k} must be at most {mtp_layers} (the MTP layers) "
                f"or a multiple of it"
            )
        return replace(spec, num_speculative_tokens=k, model=None)  # (rechecks the schedule)

    # -- per step ------------------------------------------------------------------------------

    def max_drafts(self, num_running: int, num_tokens: int) -> int:
        """The most drafts a request of `num_tokens` tokens (prompt + output) may get in a step
        with `num_running` running requests: k, or 0 when `disable_by_batch_size` is reached
        or its verify chunk would reach `max_model_len` (vLLM's rules)."""
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError(
                "speculative_config: num_speculative_tokens is not resolved yet "
                "(call for_target first)"
            )
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return 0
        if self.max_model_len is not None and num_tokens + k >= self.max_model_len:
            return 0
        return min(k, self.k_for_batch_size(num_running))

    def k_for_batch_size(self, num_running: int) -> int:
        """k of `num_speculative_tokens_per_batch_size` at this batch size (vLLM's lookup: the
        range holding it, else the last range before it); num_speculative_tokens without one."""
        k = self.num_speculative_tokens
        assert k is not None
        if self.num_speculative_tokens_per_batch_size is None:
            return k
        chosen = k
        for lo, _hi, n in self.num_speculative_tokens_per_batch_size:
            if lo > num_running:
                break
            chosen = n  # the range holding num_running, or the last one before it
        return chosen

    def max_drafting_batch(self, max_num_seqs: int) -> int:
        """The most requests that may carry drafts in one step (the state scratch rows):
        max_num_seqs, less where disable_by_batch_size or a schedule's k = 0 stops drafting."""
        rows = max_num_seqs
        if self.disable_by_batch_size is not None:
            rows = min(rows, self.disable_by_batch_size - 1)
        while rows > 0 and self.k_for_batch_size(rows) == 0:
            rows -= 1
        return rows
