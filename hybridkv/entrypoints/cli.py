"""The `hybridkv` command line. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.config import CacheConfig, ParallelConfig, SchedulerConfig, check_quantization
from hybridkv.dtypes import parse_bytes

EXIT_USAGE = 2


class CliError(Exception):
    """A user error to print as one line (exit 2)."""


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _backend_cell(backend: str | None, runner: str | None) -> str:
    """The planned backend, and the one that runs its groups where they differ (FlashMLA's
    sizes run on triton)."""
    if backend is None:
        return "-"
    return backend if runner in (None, backend) else f"{backend} (runs {runner})"


def _layer_list(layer_ids: Sequence[int]) -> str:
    text = ",".join(map(str, layer_ids))
    return text if len(text) <= 28 else text[:25] + "..."


def format_plan(plan, model: str) -> str:  # plan: MemoryPlan
    lines = [
        f"memory plan for {model} ({plan.architecture}) on {plan.platform}"
        + (
            f", per rank of tensor_parallel_size {plan.tensor_parallel_size}"
            if plan.tensor_parallel_size > 1
            else ""
        ),
        f"  page_tokens         {plan.page_tokens}"
        + ("" if plan.attention_groups else " (no attention: the prefix-hash block only)"),
        f"  page_bytes          {plan.page_bytes:,} ({_human_bytes(plan.page_bytes)})",
        f"  layers_per_group    {plan.layers_per_group}",
        f"  num_pages           {plan.num_pages:,} (1 reserved null page; "
        f"{_human_bytes(plan.total_bytes)} in {plan.layers_per_group} buffers)",
        f"  attention bytes     {plan.attention_bytes_per_token:,} per token per layer",
    ]
    if plan.state_bytes:
        lines.append(
            f"  state bytes         {plan.state_bytes:,} per layer; padding "
            f"{plan.state_padding_bytes:,} B ({plan.state_padding_pct:.2f}%)"
        )
    if plan.reserved_bytes:
        lines.append(
            f"  spec. scratch       {plan.reserved_bytes:,} B ({plan.reserved_bytes / 2**30:.2f} "
            f"GiB of the budget: speculative decoding's state scratch, {plan.scratch_rows} "
            "drafting requests)"
        )
    cap = plan.attention_token_capacity
    lines.append(
        f"  attention capacity  {cap:,} tokens"
        if cap is not None
        else "  attention capacity  unbounded (no layer grows with length)"
    )
    lines.append(
        f"  allocation          {plan.allocation} (attention groups allocate "
        f"{'kernel blocks' if plan.allocation == 'block' else 'pages'}; state groups pages)"
    )
    lines.append(
        f"  prefix caching      hash blocks of {plan.hash_block_tokens} tokens, hits in "
        f"multiples of {plan.hit_tokens}"
    )
    header = (
        "group",
        "kind",
        "layers",
        "backend",
        "page_tokens",
        "kernel_block",
        "blocks/page",
        "unit_tokens",
        "padding_B",
        "layer ids",
    )
    rows = [header] + [
        (
            str(g.group_id),
            g.kind,
            str(len(g.layer_names)),
            _backend_cell(g.backend, g.runner),
            str(g.page_tokens or "-"),
            str(g.kernel_block_size or "-"),
            str(g.blocks_per_page),
            str(g.unit_tokens or "-"),
            f"{g.padding_bytes:,}",
            _layer_list(g.layer_ids),
        )
        for g in plan.groups
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines.append("")
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="print the memory plan of a model config",
        description="Print the memory plan (pages, kernel blocks, groups) of any "
        "model config: a folder with config.json, a config.json path, or a "
        "bundled preset id.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="folder, config.json or preset id (default: the built-in default model)",
    )
    p.add_argument("--platform", default="cuda", help="cpu, cuda or rocm (default cuda)")
    p.add_argument("--backend", default=None, help="attention backend (default: the platform's)")
    p.add_argument(
        "--state-backend",
        default=None,
        help="ops of the state groups, by the name their layer kind declares (default: the "
        "first that runs on the platform)",
    )
    p.add_argument("--allocation", default="block", choices=["block", "page"])
    p.add_argument(
        "--dtype",
        default=None,
        help="the model's compute dtype (default: the checkpoint's); it decides which state "
        "ops can run",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--memory", default="40GiB", help="cache budget, e.g. 40GiB (default)")
    budget.add_argument("--num-pages", type=int, default=None, help="number of pages instead")
    _add_cache_layout_args(p)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="plan one rank of this many (per-rank heads: the page size changes with it)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding as JSON (vLLM's speculative_config); method 'mtp' plans the "
        "cache layers of the checkpoint's multi-token-prediction layers too",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def _add_cache_layout_args(p: argparse.ArgumentParser) -> None:
    """The cache's layout and the longest request (plan, generate, serve)."""
    p.add_argument(
        "--page-tokens", type=int, default=None, help="tokens per page (default: planned)"
    )
    p.add_argument(
        "--kernel-block-size",
        type=int,
        default=None,
        help="tokens per attention kernel block (default: the backend's choice)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's), float32, bfloat16, float16, fp8_e4m3 or fp8_e5m2",
    )
    p.add_argument("--state-dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument(
        "--ssm-state-dtype",
        default="auto",
        help="the recurrent part of a state (auto: the config's mamba_ssm_dtype, else the "
        "state's)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the longest request, prompt + output (default: the model's own limit)",
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from hybridkv.kv.presets import load_model_config
    from hybridkv.models.config_helpers import model_dtype
    from hybridkv.models.registry import plan_for_config

    cache = CacheConfig(
        page_tokens=args.page_tokens,
        kernel_block_size=args.kernel_block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        state_dtype=args.state_dtype,
        ssm_state_dtype=args.ssm_state_dtype,
        memory_bytes=None if args.num_pages is not None else parse_bytes(args.memory),
        num_pages=args.num_pages,
        platform=args.platform,
        attention_backend=args.backend,
        state_backend=args.state_backend,
        allocation=args.allocation,
    )
    from hybridkv.dtypes import canonical_dtype
    from hybridkv.engine import DEFAULT_MODEL

    model = args.model or str(DEFAULT_MODEL)
    name = args.model or "the built-in default model"
    dtype = None if args.dtype is None else canonical_dtype(args.dtype)
    ParallelConfig(tensor_parallel_size=args.tensor_parallel_size)  # one-line errors
    SchedulerConfig(max_model_len=args.max_model_len)
    spec = None
    if args.speculative_config is not None:
        from hybridkv.spec_decode.config import SpeculativeConfig

        spec = SpeculativeConfig.from_cli(args.speculative_config)
    mtp = spec is not None and spec.method == "mtp"
    if mtp:
        from hybridkv.models.registry import family_config

        layers = int(getattr(family_config(load_model_config(model)), "num_mtp_layers", 0) or 0)
        spec = spec.for_target(model, args.tensor_parallel_size, layers)  # one-line errors
    speculation = (0, 0)
    if spec is not None:  # its state scratch: at the engine's default max_num_seqs
        rows = spec.max_drafting_batch(SchedulerConfig().max_num_seqs)
        speculation = (rows, spec.num_speculative_tokens or 1)
    plan = plan_for_config(
        load_model_config(model), cache, args.max_model_len, dtype, args.tensor_parallel_size,
        mtp, speculation,
    )  # fmt: skip
    config = load_model_config(model)
    compute = dtype or model_dtype(config)
    kv = [g.spec.dtype for g in plan.attention_groups]
    ops = cpu_ops(op_dtypes(compute, *kv)) if args.platform == "cpu" else None
    if args.json:
        extra = {} if ops is None else {"cpu": ops[0], "ops": ops[1]}
        print(json.dumps({"model": name, **plan.to_json(), **extra}, indent=2))
    else:
        print(format_plan(plan, name))
        if ops is not None:
            print(f"\n  {ops[0]}\n\n" + format_ops(ops[1]))
    return 0


def cpu_ops(dtypes: list[str]) -> tuple[str, list[dict[str, str]]]:
    """This machine's CPU line and the op implementations chosen here for `dtypes`."""
    from hybridkv.ops import registry
    from hybridkv.ops.native import cpu

    rows = [{"op": o, "dtype": d, "implementation": i} for o, d, i in registry.table("cpu", dtypes)]
    return cpu.line(), rows


def op_dtypes(*dtypes: str | None) -> list[str]:
    """The distinct float dtypes among the model's and its caches' (the ops' input dtypes)."""
    out = []
    for d in dtypes:
        if d in ("float32", "bfloat16", "float16") and d not in out:
            out.append(d)
    return out


def format_ops(rows: list[dict[str, str]]) -> str:
    from hybridkv.ops.registry import format_table

    return format_table((r["op"], r["dtype"], r["implementation"]) for r in rows)


# ---------------------------------------------------------------------------------------------
# generate / serve / bench: they load a model
# ---------------------------------------------------------------------------------------------

DEFAULT_PROMPT = "def fibonacci(n):"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder (config.json, safetensors, tokenizer.json; without "
        "tokenizer.json prompts must be token ids); default: the built-in default model",
    )
    p.add_argument(
        "--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16"
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--memory",
        default=None,
        help="cache budget, e.g. 2GiB (default: sized for max-num-seqs requests)",
    )
    p.add_argument("--allocation", default="block", choices=["block", "page"])
    _add_cache_layout_args(p)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step, decodes plus prefill chunks (default 2048)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse cached prompt prefixes (default: on)",
    )
    p.add_argument(
        "--max-capture-size",
        type=int,
        default=None,
        help="CPU: decode steps of up to this many requests are captured and replayed "
        "natively (default 16; 0: none)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CPU: run every step eagerly (no captured decode steps)",
    )
    _add_speculative_arg(p)
    _add_quantization_arg(p)
    _add_parallel_args(p)


def _add_speculative_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (prompt-lookup drafts verified in decode steps)',
    )


def _speculative(args: argparse.Namespace) -> Any:
    """The parsed --speculative-config (a one-line error for bad JSON or keys), or None."""
    if args.speculative_config is None:
        return None
    from hybridkv.spec_decode.config import SpeculativeConfig

    return SpeculativeConfig.from_cli(args.speculative_config)


def _add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization",
        default=None,
        help="int8: weight-only int8 linears, per-output-row scales computed at load time; "
        "w8a8: the same int8 weights and activations rounded to int8 per token (AMX-INT8 "
        "tiles; faster, less exact) (CPU; the cache keeps its dtypes); default: none",
    )


def _quantization(args: argparse.Namespace) -> str | None:
    value = args.quantization
    return None if value is None or value.lower() == "none" else value


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="processes the model is sharded over (started here, or the torchrun launch's)",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds a tensor-parallel collective waits for a rank before the run fails",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine keyword arguments of the model flags (generate, serve, bench)."""
    kwargs: dict[str, Any] = {
        "dtype": args.dtype,
        "allocation": args.allocation,
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_timeout_s": args.distributed_timeout,
        "quantization": _quantization(args),
        "enforce_eager": args.enforce_eager,
    }
    optional = {
        "max_capture_size": args.max_capture_size,
        "page_tokens": args.page_tokens,
        "kernel_block_size": args.kernel_block_size,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
    }
    kwargs |= {k: v for k, v in optional.items() if v is not None}
    for name in ("kv_cache_dtype", "state_dtype", "ssm_state_dtype"):
        if getattr(args, name) != "auto":
            kwargs[name] = getattr(args, name)
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.memory is not None:
        kwargs["memory_bytes"] = parse_bytes(args.memory)
    if args.speculative_config is not None:
        kwargs["speculative_config"] = _speculative(args)
    return kwargs


def _load_engine(args: argparse.Namespace):
    """Build the engine, printing progress on stderr (model loading takes a moment)."""
    import time

    from hybridkv.engine import Engine

    kwargs = engine_kwargs(args)
    name = args.model or "the built-in default model"
    print(f"loading {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    engine = Engine(args.model, **kwargs)
    print(
        f"loaded {engine.architecture} in {time.perf_counter() - start:.1f}s "
        f"({engine.plan.num_pages} pages of {engine.plan.page_tokens} tokens)",
        file=sys.stderr,
        flush=True,
    )
    if getattr(engine, "quantization", None) is not None:
        print(engine.quantization.summary(), file=sys.stderr, flush=True)
    return engine


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions with a model (default: the built-in "
        "one). Prompts come from --prompt (repeatable), --prompts-file (one "
        "per line) and --prompt-ids (repeatable), in that order. A model without "
        "tokenizer.json takes --prompt-ids only.",
    )
    _add_model_args(p)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a file with one prompt per line")
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=None,
        metavar="IDS",
        help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable); it prints "
        "'PROMPT_IDS -> GENERATED_IDS' and then the text, if the model has a tokenizer "
        "(with --json: the prompt is the id list)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        ids = []
    if not ids or any(t < 0 for t in ids):
        raise CliError(f"--prompt-ids takes comma-separated token ids, e.g. 1,2,3; got {text!r}")
    return ids


def _ids_text(ids: list[int]) -> str:
    return ",".join(str(t) for t in ids)


def _read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    prompts: list[str | list[int]] = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        except OSError as exc:
            raise CliError(
                f"cannot read --prompts-file {args.prompts_file!r}: {exc.strerror}"
            ) from None
    prompts += [_parse_ids(text) for text in args.prompt_ids or []]
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from hybridkv.entrypoints.llm import LLM
    from hybridkv.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    prompts = _read_prompts(args)
    llm = LLM.__new__(LLM)
    llm.engine = _load_engine(args)
    if not prompts:
        print(
            f"no prompt given: using {DEFAULT_PROMPT!r} (give --prompt, --prompts-file or "
            "--prompt-ids)",
            file=sys.stderr,
            flush=True,
        )
        prompts = [DEFAULT_PROMPT]
    if llm.engine.tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise CliError(
            f"{llm.engine._no_tokenizer()}: give prompts as token ids with --prompt-ids, "
            "e.g. --prompt-ids 1,2,3"
        )
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            row = {
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
            }
            print(json.dumps(row | ({} if out.error is None else {"error": out.error})))
        else:
            if isinstance(prompt, list):
                print(f"{_ids_text(prompt)} -> {_ids_text(out.token_ids)}")
                if out.text:
                    print(out.text)
            else:
                print(f"{prompt}{out.text}")
            print(
                f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}",
                file=sys.stderr,
            )
        if out.error is not None:
            print(f"hybridkv generate: error: {out.error}", file=sys.stderr)
    # an engine failure, not a usage error: exit 1
    return 1 if any(out.error is not None for out in outs) else 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve /v1/models, /v1/completions, /v1/chat/completions, "
        "/health and /metrics.",
    )
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: --model, or 'hybridkv-default')",
    )
    p.add_argument(
        "--max-request-bytes",
        default="4MiB",
        help="the largest request body taken, e.g. 4MiB (default); larger ones get a 413",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes (JSON in <tool_call> tags) or qwen3_coder "
        "(<function=...> XML); default: read from the chat template",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think>...</think> into reasoning_content: qwen3 or deepseek_r1 "
        "(default: none)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind one endpoint, on Ray Serve (needs ray[serve]); default 1",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto) instead of starting one (implies Ray Serve)",
    )
    p.add_argument(
        "--routing-policy",
        default="prefix_aware",
        help="how the replicas share requests: prefix_aware (default), least_loaded, round_robin",
    )
    p.set_defaults(func=cmd_serve)


def _check_parsers(args: argparse.Namespace) -> None:
    from hybridkv.entrypoints.reasoning import get_reasoning_parser
    from hybridkv.entrypoints.tool_parsers import get_tool_parser

    try:
        if args.tool_call_parser is not None:
            get_tool_parser(args.tool_call_parser)
        if args.reasoning_parser is not None:
            get_reasoning_parser(args.reasoning_parser)
    except ValueError as exc:
        flag = "--tool-call-parser" if "tool" in str(exc) else "--reasoning-parser"
        raise CliError(f"{flag}: {exc}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from hybridkv.entrypoints.server import bind_socket, serve

    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {args.port}")
    try:
        max_request_bytes = parse_bytes(args.max_request_bytes)
    except ValueError as exc:
        raise CliError(f"--max-request-bytes: {exc}") from None
    if max_request_bytes < 1:
        raise CliError(f"--max-request-bytes must be at least 1 byte, got {args.max_request_bytes}")
    _check_parsers(args)
    if args.data_parallel_size < 1:
        raise CliError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    policies = ("prefix_aware", "least_loaded", "round_robin")
    if args.routing_policy not in policies:
        raise CliError(
            f"--routing-policy: unknown policy {args.routing_policy!r} "
            f"(choose from {', '.join(policies)})"
        )
    if args.data_parallel_size > 1 or args.ray_address is not None:
        if args.tensor_parallel_size != 1:
            raise CliError("--data-parallel-size with --tensor-parallel-size > 1 is not supported")
        if importlib.util.find_spec("ray") is None:
            raise CliError('--data-parallel-size needs Ray Serve: pip install "ray[serve]"')
        try:  # the port is free now (Ray Serve's proxy binds it later)
            bind_socket(args.host, args.port).close()
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise CliError(f"cannot listen on {args.host}:{args.port}: {reason}") from None
        from hybridkv.serving.ray_app import run_cli

        return run_cli(args, max_request_bytes)
    # The address is taken before the model loads: a busy port is an error at once.
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise CliError(f"cannot listen on {args.host}:{args.port}: {reason}") from None
    try:
        engine = _load_engine(args)
        name = args.served_model_name or args.model or "hybridkv-default"
        fatal = serve(
            engine, name, args.host, args.port, max_request_bytes, sock=sock,
            tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        )  # fmt: skip
    finally:
        sock.close()
    if fatal is not None:
        print(f"hybridkv serve: error: {fatal}", file=sys.stderr)
        return 1
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure generation throughput on a model",
        description="Generate for random prompts all submitted at once and "
        "print output tokens per second (optionally next to transformers).",
    )
    p.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    _add_speculative_arg(p)
    _add_quantization_arg(p)
    _add_parallel_args(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from hybridkv.engine import DEFAULT_MODEL
    from hybridkv.entrypoints.bench import random_prompts, run_hybridkv, run_transformers
    from hybridkv.kv.presets import load_model_config
    from hybridkv.models.registry import family_config

    if args.requests < 1 or args.new_tokens < 1 or not 0 < args.min_prompt <= args.max_prompt:
        raise CliError(
            "--requests and --new-tokens must be >= 1 and 0 < --min-prompt <= --max-prompt"
        )
    if args.compare_transformers and importlib.util.find_spec("transformers") is None:
        raise CliError(
            "--compare-transformers needs the transformers package, which is not installed "
            "(pip install transformers)"
        )
    quantization = _quantization(args)
    check_quantization(quantization)  # before any prompt is made
    from hybridkv.engine import ModelConfig

    ModelConfig(dtype=args.dtype)  # a bad dtype: one line before anything is printed
    speculative = _speculative(args)
    folder = args.model or str(DEFAULT_MODEL)
    vocab = family_config(load_model_config(folder)).vocab_size
    prompts = random_prompts(vocab, args.requests, args.min_prompt, args.max_prompt, args.seed)
    tokens = args.requests * args.new_tokens
    print(
        f"bench: {args.requests} requests, prompts {args.min_prompt}..{args.max_prompt}, "
        f"{args.new_tokens} new tokens each",
        file=sys.stderr,
        flush=True,
    )
    parallel = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_timeout_s": args.distributed_timeout,
    }
    cpu_line, ops = cpu_ops(op_dtypes(args.dtype))
    print(f"{cpu_line}\n{format_ops(ops)}", file=sys.stderr, flush=True)
    engines: list = []
    seconds = run_hybridkv(
        folder, prompts, args.new_tokens, dtype=args.dtype, quantization=quantization,
        speculative_config=speculative, engines=engines, **parallel,
    )  # fmt: skip
    rows = [("hybridkv", seconds)]
    if args.compare_transformers:
        rows.append(("transformers", run_transformers(folder, prompts, args.new_tokens)))
    result = [
        {
            "engine": e,
            "seconds": round(t, 3),
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / t, 1),
            "cpu": cpu_line,
        }
        for e, t in rows
    ]
    spec = engines[0].spec_stats if speculative is not None else None
    if spec is not None:
        result[0]["spec_decode"] = spec.as_dict()
    if args.json:
        print(json.dumps(result))
    else:
        for r in result:
            print(f"{r['engine']:<13} {r['tokens_per_s']:>9.1f} tokens/s  ({r['seconds']} s)")
        if spec is not None:
            print(spec.summary())
    return 0


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate,
    _add_serve,
    _add_plan,
    _add_bench,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="hybridkv: an inference engine for hybrid LLMs with a paged cache whose "
        "pages are decoupled from attention kernel blocks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, CliError, FileNotFoundError) as exc:
        print(f"hybridkv {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"hybridkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `hybridkv plan --json | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
