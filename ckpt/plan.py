"""ckpt plan: how often to checkpoint, given size, bandwidth, stall and failure rate.

Library use: :func:`make_plan` (pure) and :func:`measure_bandwidth` (real I/O through fsspec).
CLI use: the ``ckpt`` command wires :func:`add_plan_arguments` and :func:`run_plan`;
``python -m ckpt.plan ...`` runs the same thing standalone. Formulas: docs/cadence.md.
The unit parsers (:mod:`ckpt.units`) and the bandwidth probe (:mod:`ckpt.bandwidth`) live in
their own modules and are re-exported here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ckpt.bandwidth import BandwidthMeasurement, measure_bandwidth
from ckpt.units import parse_bandwidth, parse_duration, parse_fraction, parse_size
from ckpt.young_daly import optimal_interval, young_daly_interval

__all__ = [
    "Plan",
    "BandwidthMeasurement",
    "make_plan",
    "TierPlans",
    "make_tier_plans",
    "format_plan",
    "measure_bandwidth",
    "parse_size",
    "parse_bandwidth",
    "add_plan_arguments",
    "run_plan",
    "main",
]

HOST_COPY_BYTES_PER_SECOND = 10e9
"""Default device-to-host staging bandwidth used to estimate the stall when ``--stall`` is not
given: a conservative figure for one GPU's copy into pinned host memory over PCIe 4/5."""


@dataclass(frozen=True)
class Plan:
    """A recommended cadence and what it costs; all times in seconds, JSON-safe."""

    size_bytes: int
    bandwidth_bytes_per_second: float
    bandwidth_source: str
    """``"given"`` or ``"measured"`` (then ``measured_*`` hold both directions)."""
    persist_seconds: float
    """``size / bandwidth``: background write time of one checkpoint."""
    stall_seconds: float
    """Training blocked per checkpoint (delta): given, or ``size / HOST_COPY_BYTES_PER_SECOND``."""
    mtbf_seconds: float
    restart_seconds: float
    step_seconds: float | None
    overhead_budget: float | None
    young_daly_seconds: float
    interval_seconds: float
    """Recommended compute time between checkpoints (tau), rounded up to whole steps."""
    interval_steps: int | None
    active_bound: str
    """``"young_daly"``, ``"bandwidth"`` or ``"overhead_budget"``."""
    overhead_fraction: float
    """``delta / tau``."""
    rework_seconds_per_failure: float
    """``(tau + delta) / 2 + persist``: expected work redone after a failure."""
    lost_seconds_per_failure: float
    """``rework + restart``."""
    goodput: float
    """``1 - delta/tau - (rework + R) / M``, clipped at 0."""
    measured_write_bytes_per_second: float | None = None
    measured_read_bytes_per_second: float | None = None
    load_seconds: float = 0.0
    """Reading the checkpoint back after a restart (counted with ``restart_seconds`` in the
    lost work; 0 unless given: ``ckpt plan`` folds it into ``--restart``)."""


def make_plan(
    size_bytes: int,
    bandwidth_bytes_per_second: float,
    *,
    stall_seconds: float | None = None,
    mtbf_seconds: float = 86400.0,
    restart_seconds: float = 60.0,
    step_seconds: float | None = None,
    overhead_budget: float | None = None,
    measurement: BandwidthMeasurement | None = None,
    load_seconds: float = 0.0,
    interval_seconds: float | None = None,
) -> Plan:
    """The cadence ``Auto`` would settle on for these inputs, with its expected costs.

    ``load_seconds``: reading the checkpoint back after a restart, lost with the restart.
    ``interval_seconds``: evaluate this interval instead of choosing one (``active_bound``
    is then ``"given"``)."""
    if size_bytes < 0:
        raise ValueError(f"size_bytes={size_bytes!r} is invalid: pass the checkpoint size >= 0")
    if not bandwidth_bytes_per_second > 0:
        raise ValueError(f"bandwidth={bandwidth_bytes_per_second!r} is invalid: pass bytes per second > 0")
    if step_seconds is not None and not step_seconds > 0:
        raise ValueError(f"step_seconds={step_seconds!r} is invalid: pass the step time > 0 s, or omit it")
    if not restart_seconds >= 0:
        raise ValueError(f"restart_seconds={restart_seconds!r} is invalid: pass seconds >= 0")
    delta = size_bytes / HOST_COPY_BYTES_PER_SECOND if stall_seconds is None else float(stall_seconds)
    persist = size_bytes / bandwidth_bytes_per_second
    if interval_seconds is None:
        tau, bound = optimal_interval(delta, mtbf_seconds, persist, overhead_budget)
    else:
        tau, bound = float(interval_seconds), "given"
    steps = None
    if step_seconds is not None:
        steps = max(1, math.ceil(tau / step_seconds - 1e-9))
        tau = steps * step_seconds
    overhead = delta / tau if tau > 0 else math.inf
    rework = (tau + delta) / 2 + persist
    lost = rework + restart_seconds + load_seconds
    goodput = max(0.0, 1.0 - overhead - lost / mtbf_seconds)
    return Plan(
        size_bytes=int(size_bytes),
        bandwidth_bytes_per_second=float(bandwidth_bytes_per_second),
        bandwidth_source="measured" if measurement else "given",
        persist_seconds=persist,
        stall_seconds=delta,
        mtbf_seconds=float(mtbf_seconds),
        restart_seconds=float(restart_seconds),
        step_seconds=step_seconds,
        overhead_budget=overhead_budget,
        young_daly_seconds=young_daly_interval(delta, mtbf_seconds),
        interval_seconds=tau,
        interval_steps=steps,
        active_bound=bound,
        overhead_fraction=min(overhead, 1.0),
        rework_seconds_per_failure=rework,
        lost_seconds_per_failure=lost,
        goodput=goodput,
        measured_write_bytes_per_second=measurement.write_bytes_per_second if measurement else None,
        measured_read_bytes_per_second=measurement.read_bytes_per_second if measurement else None,
        load_seconds=float(load_seconds),
    )


@dataclass(frozen=True)
class TierPlans:
    """Advice for two tiers (``ckpt.tiers``): each tier's plan and the goodput of both."""

    local: Plan
    """The local tier: its own bandwidth, every failure's MTBF."""
    durable: Plan
    """The durable tier: its bandwidth, the MTBF of node losses (failures the local tier
    does not survive); its interval a whole multiple of the local one (``active_bound``
    ``"given"``), so that every durable save falls on a local save's step and shares its
    stall."""
    goodput: float
    """``1 - delta/tau_L - (1/M - 1/M_N) lost_L - lost_D / M_N``, ``lost`` = rework +
    restart + load (reading the checkpoint back from that tier): a failure the local tier
    survives redoes the local tier's rework and reads the local copy, a node loss redoes
    the durable tier's and reads the durable copy. The stall is paid once per local save
    (the durable saves share it)."""
    durable_only_goodput: float
    """The goodput of the durable tier alone, at every failure's MTBF, load included, to
    compare: a local tier pays off when the durable persist or load is long and most
    failures keep their nodes; when the stall dominates, it does not."""


def make_tier_plans(size_bytes: int, bandwidth_bytes_per_second: float,
                    local_bandwidth_bytes_per_second: float, *,
                    node_mtbf_seconds: float | None = None, mtbf_seconds: float = 86400.0,
                    **options: Any) -> TierPlans:
    """Both tiers' intervals, as their ``Auto`` would settle (docs/cadence.md#two-tiers).

    ``node_mtbf_seconds``: mean time between failures that lose a node's local tier (None:
    every failure does, ``mtbf_seconds``); it cannot be below ``mtbf_seconds``. Other
    ``options`` as for :func:`make_plan`, for both tiers."""
    node_mtbf = mtbf_seconds if node_mtbf_seconds is None else float(node_mtbf_seconds)
    if not node_mtbf >= mtbf_seconds:
        raise ValueError(f"node MTBF {node_mtbf!r} s is below the job's MTBF {mtbf_seconds!r} s, "
                         f"but node losses are a subset of all failures: pass a node MTBF >= "
                         f"the MTBF")
    measurement = options.pop("measurement", None)
    local_bw, durable_bw = local_bandwidth_bytes_per_second, bandwidth_bytes_per_second
    local = make_plan(size_bytes, local_bw, mtbf_seconds=mtbf_seconds,
                      load_seconds=size_bytes / local_bw, **options)
    durable = make_plan(size_bytes, durable_bw, mtbf_seconds=node_mtbf,
                        load_seconds=size_bytes / durable_bw, measurement=measurement,
                        **options)
    # The durable interval a whole multiple of the local one: each durable save is a step
    # the local tier saves too, staged once (ckpt.tiers), so it adds no stall of its own.
    multiple = max(1, round(durable.interval_seconds / local.interval_seconds))
    durable = make_plan(size_bytes, durable_bw, mtbf_seconds=node_mtbf,
                        load_seconds=size_bytes / durable_bw, measurement=measurement,
                        interval_seconds=multiple * local.interval_seconds, **options)
    survived_rate = 1.0 / mtbf_seconds - 1.0 / node_mtbf
    goodput = (1.0 - local.overhead_fraction
               - survived_rate * local.lost_seconds_per_failure
               - durable.lost_seconds_per_failure / node_mtbf)
    alone = make_plan(size_bytes, durable_bw, mtbf_seconds=mtbf_seconds,
                      load_seconds=size_bytes / durable_bw, **options)
    return TierPlans(local, durable, max(0.0, goodput), alone.goodput)


def _arg(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:  # argparse would replace a ValueError's message with its own
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``ckpt plan``'s options to ``parser`` (a subcommand parser)."""
    parser.add_argument("--size", type=_arg(parse_size), required=True,
                        help="checkpoint size, all ranks together, e.g. 14GB or 800GiB")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bandwidth", type=_arg(parse_bandwidth),
                        help="aggregate storage write bandwidth, e.g. 2GB/s")
    source.add_argument("--measure", metavar="URL",
                        help="measure write/read bandwidth at this fsspec URL (local path, s3://...)")
    parser.add_argument("--measure-bytes", type=_arg(parse_size), default=256 * 2**20,
                        help="test object size for --measure (default 256MiB)")
    parser.add_argument("--endpoint-url", help="S3 endpoint for --measure s3://... (e.g. MinIO)")
    parser.add_argument("--stall", type=_arg(parse_duration), default=None,
                        help="training stall per checkpoint; default size / 10GB/s host copy")
    parser.add_argument("--mtbf", type=_arg(parse_duration), default=86400.0,
                        help="job mean time between failures (default 24h)")
    parser.add_argument("--restart", type=_arg(parse_duration), default=60.0,
                        help="time to restart after a failure (default 60s)")
    parser.add_argument("--step-time", type=_arg(parse_duration), default=None,
                        help="seconds per training step, to express the interval in steps")
    parser.add_argument("--overhead-budget", type=_arg(parse_fraction), default=None,
                        help="cap on stall per interval, e.g. 0.01 or 1%% (default: none)")
    parser.add_argument("--local-bandwidth", type=_arg(parse_bandwidth), default=None,
                        help="with a local tier: its aggregate write bandwidth (per node "
                             "times nodes), e.g. 40GB/s; advises both tiers' intervals")
    parser.add_argument("--node-mtbf", type=_arg(parse_duration), default=None,
                        help="with --local-bandwidth: mean time between node losses, the "
                             "failures the local tier does not survive (default: --mtbf)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan(args: argparse.Namespace) -> int:
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
        if args.local_bandwidth is not None:
            tiers = make_tier_plans(args.size, bandwidth, args.local_bandwidth,
                                    node_mtbf_seconds=args.node_mtbf, **options)
            print(json.dumps(asdict(tiers), indent=2) if args.json else format_tiers(tiers))
            return 0
        plan = make_plan(args.size, bandwidth, **options)
    except ValueError as exc:
        print(f"ckpt plan: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ckpt plan: measuring bandwidth at {args.measure!r} failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
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


def format_plan(plan: Plan) -> str:
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


def format_tiers(tiers: TierPlans) -> str:
    """Both tiers' tables, then the interval settings and the goodput of both together."""
    def setting(plan: Plan) -> str:
        if plan.interval_steps is not None:
            return f'"{plan.interval_steps}"'
        return f'"{max(1, math.ceil(plan.interval_seconds))}s"'

    out = ["local tier (all failures)", format_plan(tiers.local), "",
           "durable tier (node losses)", format_plan(tiers.durable), "",
           f"checkpoint.local_interval = {setting(tiers.local)}",
           f"checkpoint.interval = {setting(tiers.durable)}",
           f"expected goodput, both tiers: {100 * tiers.goodput:.2f} % (durable tier alone: "
           f"{100 * tiers.durable_only_goodput:.2f} %)"]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckpt.plan``: the same as ``ckpt plan``."""
    parser = argparse.ArgumentParser(prog="ckpt plan", description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
