"""The `hybridkv` command line. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from hybridkv.config import CacheConfig
from hybridkv.dtypes import parse_bytes

EXIT_USAGE = 2
DEFAULT_PLAN_MODEL = "ibm-granite/granite-4.0-h-small"


class CliError(Exception):
    """A user error to print as one line (exit 2)."""


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _layer_list(names: Sequence[str]) -> str:
    indices = [n.split(".")[1] for n in names]
    text = ",".join(indices)
    return text if len(text) <= 28 else text[:25] + "..."


def format_plan(plan, model: str) -> str:  # plan: MemoryPlan
    lines = [
        f"memory plan for {model} ({plan.architecture}) on {plan.platform}",
        f"  page_tokens         {plan.page_tokens}",
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
    cap = plan.attention_token_capacity
    lines.append(
        f"  attention capacity  {cap:,} tokens"
        if cap is not None
        else "  attention capacity  unbounded (no layer grows with length)"
    )
    header = (
        "group",
        "kind",
        "layers",
        "backend",
        "page_tokens",
        "kernel_block",
        "blocks/page",
        "padding_B",
        "layer ids",
    )
    rows = [header] + [
        (
            str(g.group_id),
            g.kind,
            str(len(g.layer_names)),
            g.backend or "-",
            str(g.page_tokens or "-"),
            str(g.kernel_block_size or "-"),
            str(g.blocks_per_page),
            f"{g.padding_bytes:,}",
            _layer_list(g.layer_names),
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
        default=DEFAULT_PLAN_MODEL,
        help=f"folder, config.json or preset id (default {DEFAULT_PLAN_MODEL})",
    )
    p.add_argument("--platform", default="cuda", help="cpu, cuda or rocm (default cuda)")
    p.add_argument("--backend", default=None, help="attention backend (default: the platform's)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--memory", default="40GiB", help="cache budget, e.g. 40GiB (default)")
    budget.add_argument("--num-pages", type=int, default=None, help="number of pages instead")
    p.add_argument("--page-tokens", type=int, default=None)
    p.add_argument("--kernel-block-size", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--state-dtype", default="auto")
    p.add_argument("--ssm-state-dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from hybridkv.kv.plan import plan_for_config
    from hybridkv.kv.presets import load_model_config

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
    )
    plan = plan_for_config(load_model_config(args.model), cache, args.max_model_len)
    if args.json:
        print(json.dumps({"model": args.model, **plan.to_json()}, indent=2))
    else:
        print(format_plan(plan, args.model))
    return 0


# ---------------------------------------------------------------------------------------------


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_plan]


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


if __name__ == "__main__":
    sys.exit(main())
