"""``ckpt plan``: the interval advice of :mod:`ckpt.cadence.plan`, as a command.

``python -m ckpt.cli._plan ...`` runs the same thing standalone. Exit status: 0 ok, 1 the
bandwidth measurement failed, 2 invalid input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import Any, Sequence

from ckpt.cadence import (
    CadencePlan,
    TierCadencePlans,
    make_cadence_plan,
    make_tier_cadence_plans,
    measure_bandwidth,
)
from ckpt.cli._common import arg_type, with_unit
from ckpt.units import parse_bandwidth, parse_duration, parse_fraction, parse_size

__all__ = ["add_cadence_plan_arguments", "run_cadence_plan", "format_cadence_plan",
           "format_tier_cadence_plans", "main"]


def add_cadence_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``ckpt plan``'s options to ``parser`` (a subcommand parser)."""
    parser.add_argument("--size", type=arg_type(with_unit(parse_size, "GB")), required=True,
                        help="checkpoint size, all ranks together, e.g. 14GB or 800GiB")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bandwidth", type=arg_type(with_unit(parse_bandwidth, "GB/s")),
                        help="aggregate storage write bandwidth, e.g. 2GB/s")
    source.add_argument("--measure", metavar="URL",
                        help="measure write/read bandwidth at this fsspec URL (local path, s3://...)")
    parser.add_argument("--measure-bytes", type=arg_type(with_unit(parse_size, "MiB")),
                        default=256 * 2**20,
                        help="test object size for --measure (default 256MiB)")
    parser.add_argument("--endpoint-url", help="S3 endpoint for --measure s3://... (e.g. MinIO)")
    parser.add_argument("--stall", type=arg_type(parse_duration), default=None,
                        help="training stall per checkpoint; default size / 10GB/s host copy")
    parser.add_argument("--mtbf", type=arg_type(parse_duration), default=86400.0,
                        help="job mean time between failures (default 24h)")
    parser.add_argument("--restart", type=arg_type(parse_duration), default=60.0,
                        help="time to restart after a failure (default 60s)")
    parser.add_argument("--step-time", type=arg_type(parse_duration), default=None,
                        help="seconds per training step, to express the interval in steps")
    parser.add_argument("--overhead-budget", type=arg_type(parse_fraction), default=None,
                        help="cap on stall per interval, e.g. 0.01 or 1%% (default: none)")
    parser.add_argument("--local-bandwidth", type=arg_type(with_unit(parse_bandwidth, "GB/s")),
                        default=None,
                        help="with a local tier: its aggregate write bandwidth (per node "
                             "times nodes), e.g. 40GB/s; advises both tiers' intervals")
    parser.add_argument("--node-mtbf", type=arg_type(parse_duration), default=None,
                        help="with --local-bandwidth: mean time between node losses, the "
                             "failures the local tier does not survive (default: --mtbf)")
    parser.add_argument("--local-copies", type=int, choices=(1, 2), default=1,
                        help="with --local-bandwidth: copies of each node's local checkpoints "
                             "(checkpoint.local_copies); 2: also on the next node, so the "
                             "local tier survives a lost node (needs --nodes)")
    parser.add_argument("--nodes", type=arg_type(_count), default=None,
                        help="with --local-copies 2: the job's nodes (a second loss must hit "
                             "a neighbour of the first to take the local tier down)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_cadence_plan(args: argparse.Namespace) -> int:
    """Run ``ckpt plan`` for parsed ``args``: print the plan, return the exit status
    (0 ok, 1 bandwidth measurement failed, 2 invalid input)."""
    measurement = None
    try:
        if args.measure:
            options: dict[str, Any] = {}
            if args.endpoint_url:
                options["client_kwargs"] = {"endpoint_url": args.endpoint_url}
            measurement = measure_bandwidth(args.measure, args.measure_bytes, options)
        bandwidth = measurement.write_bytes_per_second if measurement else args.bandwidth
        options = dict(stall_seconds=args.stall, mtbf_seconds=args.mtbf,
                       restart_seconds=args.restart, step_seconds=args.step_time,
                       overhead_budget=args.overhead_budget, measurement=measurement)
        if args.node_mtbf is not None and args.local_bandwidth is None:
            raise ValueError("--node-mtbf needs --local-bandwidth (it sets the durable tier's "
                             "MTBF when a local tier is used)")
        if (args.local_copies != 1 or args.nodes is not None) and args.local_bandwidth is None:
            raise ValueError("--local-copies and --nodes need --local-bandwidth (they are "
                             "about the local tier)")
        if args.local_copies == 2 and args.nodes is None:
            raise ValueError("--local-copies 2 needs --nodes N: the local tier is lost when "
                             "a neighbour of a lost node is lost too, and how likely that is "
                             "depends on the number of nodes")
        if args.local_bandwidth is not None:
            tiers = make_tier_cadence_plans(args.size, bandwidth, args.local_bandwidth,
                                    node_mtbf_seconds=args.node_mtbf,
                                    copies=args.local_copies,
                                    num_nodes=args.nodes if args.local_copies == 2 else None,
                                    **options)
            print(json.dumps(asdict(tiers), indent=2) if args.json
                  else format_tier_cadence_plans(tiers))
            return 0
        plan = make_cadence_plan(args.size, bandwidth, **options)
    except ValueError as exc:
        print(f"ckpt plan: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ckpt plan: measuring bandwidth at {args.measure!r} failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(plan), indent=2) if args.json else format_cadence_plan(plan))
    return 0


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _secs(s: float) -> str:
    if s >= 3600:
        return f"{s:,.1f} s ({s / 3600:.2f} h)"
    if s >= 60:
        return f"{s:,.1f} s ({s / 60:.1f} min)"
    return f"{s:.2f} s"


def format_cadence_plan(plan: CadencePlan) -> str:
    """The human table ``ckpt plan`` prints."""
    bw = f"{_bytes(plan.bandwidth_bytes_per_second)}/s ({plan.bandwidth_source})"
    rows = [("checkpoint size", _bytes(plan.size_bytes)), ("storage bandwidth", bw)]
    if plan.measured_read_bytes_per_second is not None:
        rows.append(("measured read", f"{_bytes(plan.measured_read_bytes_per_second)}/s"))
    rows += [
        ("persist time", _secs(plan.persist_seconds)),
        ("stall per checkpoint", _secs(plan.stall_seconds)),
        ("MTBF", _secs(plan.mtbf_seconds)),
        ("restart cost", _secs(plan.restart_seconds)),
        *([("load after restart", _secs(plan.load_seconds))] if plan.load_seconds else []),
        ("Young/Daly interval", _secs(plan.young_daly_seconds)),
        ("recommended interval", _secs(plan.interval_seconds)
         + ("" if plan.interval_steps is None else f" = {plan.interval_steps} steps")),
        ("active bound", plan.active_bound if plan.active_bound != "given"
         else "given (a multiple of the local tier's interval)"),
        ("checkpoint overhead", f"{100 * plan.overhead_fraction:.3f} %"),
        ("rework per failure", _secs(plan.rework_seconds_per_failure)),
        ("lost per failure", _secs(plan.lost_seconds_per_failure)),
        ("expected goodput", f"{100 * plan.goodput:.2f} %"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def format_tier_cadence_plans(tiers: TierCadencePlans) -> str:
    """Both tiers' tables, then the interval settings and the goodput of both together."""
    def setting(plan: CadencePlan) -> str:
        if plan.interval_steps is not None:
            return f'"{plan.interval_steps}"'
        return f'"{max(1, math.ceil(plan.interval_seconds))}s"'

    if tiers.copies == 2:
        durable = "durable tier (a node lost with a neighbour: the local tier's copies gone)"
        copies = [f"local copies: 2 (each node's also on the next of {tiers.num_nodes} "
                  f"nodes): a node loss takes the local tier down only if a neighbour is "
                  f"lost within {_secs(tiers.vulnerable_seconds)}, "
                  f"p = {tiers.second_loss_probability:.3g} per node loss",
                  "checkpoint.local_copies = 2"]
    else:
        durable, copies = "durable tier (node losses)", []
    out = ["local tier (all failures)", format_cadence_plan(tiers.local), "",
           durable, format_cadence_plan(tiers.durable), "", *copies,
           f"checkpoint.local_interval = {setting(tiers.local)}",
           f"checkpoint.interval = {setting(tiers.durable)}",
           f"expected goodput, both tiers: {100 * tiers.goodput:.2f} % (durable tier alone: "
           f"{100 * tiers.durable_only_goodput:.2f} %)"]
    return "\n".join(out)


def _count(text: str) -> int:
    """A whole number >= 1 (``--nodes``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"invalid count {text!r}: pass a whole number >= 1, e.g. 16")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckpt.cli._plan``: the same as ``ckpt plan``."""
    parser = argparse.ArgumentParser(prog="ckpt plan",
                                     description="recommend a checkpoint interval")
    add_cadence_plan_arguments(parser)
    return run_cadence_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
