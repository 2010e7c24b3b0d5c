"""Interval advice: how often to checkpoint, given size, bandwidth, stall and failure rate.

:func:`make_cadence_plan` (one tier) and :func:`make_tier_cadence_plans` (a local tier
under the durable one) are pure; ``ckpt plan`` (:mod:`ckpt.cli._plan`) prints them,
measuring the bandwidth first when asked (:mod:`ckpt.cadence.bandwidth`). Formulas: docs/cadence.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckpt.cadence.bandwidth import BandwidthMeasurement
from ckpt.cadence.young_daly import optimal_interval, young_daly_interval

__all__ = [
    "CadencePlan",
    "make_cadence_plan",
    "TierCadencePlans",
    "make_tier_cadence_plans",
    "HOST_COPY_BYTES_PER_SECOND",
]

HOST_COPY_BYTES_PER_SECOND = 10e9
"""Default device-to-host staging bandwidth used to estimate the stall when ``--stall`` is not
given: a conservative figure for one GPU's copy into pinned host memory over PCIe 4/5."""


@dataclass(frozen=True)
class CadencePlan:
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


def make_cadence_plan(
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
) -> CadencePlan:
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
    return CadencePlan(
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
class TierCadencePlans:
    """Advice for two tiers (``ckpt.job.tiers``): each tier's plan and the goodput of both."""

    local: CadencePlan
    """The local tier: its own bandwidth, every failure's MTBF."""
    durable: CadencePlan
    """The durable tier: its bandwidth, the MTBF of the failures the local tier does not
    survive (node losses; with ``copies=2``, losses of a node's neighbour soon after the
    node: see ``second_loss_probability``); its interval a whole multiple of the local one
    (``active_bound`` ``"given"``), so that every durable save falls on a local save's step
    and shares its stall."""
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
    copies: int = 1
    """Copies of each node's local checkpoints: 1, or 2 (also on the next node)."""
    num_nodes: int | None = None
    """Nodes of the job (with ``copies=2``)."""
    vulnerable_seconds: float | None = None
    """With ``copies=2``: how long after a node loss a second loss next to it still
    takes the local tier down, ``W = restart + local load + local interval + local
    persist`` (the lost node's part is back once the job resumed; its predecessor's is
    on two nodes again once its next local save was copied)."""
    second_loss_probability: float | None = None
    """With ``copies=2``: the chance that a node loss is followed, within ``W``, by the
    loss of one of its ``min(2, N - 1)`` neighbours, ``1 - exp(-k W / (N M_node))``: the
    share of node losses the local tier does not survive."""


def make_tier_cadence_plans(size_bytes: int, bandwidth_bytes_per_second: float,
                    local_bandwidth_bytes_per_second: float, *,
                    node_mtbf_seconds: float | None = None, mtbf_seconds: float = 86400.0,
                    copies: int = 1, num_nodes: int | None = None,
                    **options: Any) -> TierCadencePlans:
    """Both tiers' intervals, as their ``Auto`` would settle (docs/cadence.md#two-tiers).

    ``node_mtbf_seconds``: mean time between failures that lose a node's local tier (None:
    every failure does, ``mtbf_seconds``); it cannot be below ``mtbf_seconds``.
    ``copies``: copies of each node's local checkpoints (1, or 2: also on the next node,
    ``checkpoint.local_copies``); with 2 the local tier survives a node loss unless a
    neighbour of the node is lost too before its part is on two nodes again, which needs
    ``num_nodes`` (>= 2; ``TierCadencePlans.second_loss_probability`` says how). Other
    ``options`` as for :func:`make_cadence_plan`, for both tiers."""
    node_mtbf = mtbf_seconds if node_mtbf_seconds is None else float(node_mtbf_seconds)
    if not node_mtbf >= mtbf_seconds:
        raise ValueError(f"node MTBF {node_mtbf!r} s is below the job's MTBF {mtbf_seconds!r} s, "
                         f"but node losses are a subset of all failures: pass a node MTBF >= "
                         f"the MTBF")
    if copies not in (1, 2):
        raise ValueError(f"copies={copies!r} is invalid: pass 1 (each node keeps its own "
                         f"local checkpoints) or 2 (and a copy on the next node)")
    if copies == 2 and (num_nodes is None or num_nodes < 2):
        raise ValueError(f"copies=2 needs the number of nodes (>= 2), got {num_nodes!r}: "
                         f"a lost node's copy is on its neighbour, and how likely that one is "
                         f"lost too depends on how many nodes share the losses")
    measurement = options.pop("measurement", None)
    local_bw, durable_bw = local_bandwidth_bytes_per_second, bandwidth_bytes_per_second
    local = make_cadence_plan(size_bytes, local_bw, mtbf_seconds=mtbf_seconds,
                      load_seconds=size_bytes / local_bw, **options)
    # The failures the local tier does not survive: every node loss, or with a copy on the
    # next node a node loss followed, within the window, by the loss of a neighbour.
    lost_mtbf, window, second = node_mtbf, None, None
    if copies == 2:
        window = (local.restart_seconds + local.load_seconds + local.interval_seconds
                  + local.persist_seconds)
        neighbours = min(2, num_nodes - 1)
        second = -math.expm1(-neighbours * window / (num_nodes * node_mtbf))
        lost_mtbf = node_mtbf / second  # window > 0: the local interval at least
    durable = make_cadence_plan(size_bytes, durable_bw, mtbf_seconds=lost_mtbf,
                        load_seconds=size_bytes / durable_bw, measurement=measurement,
                        **options)
    # The durable interval a whole multiple of the local one: each durable save is a step
    # the local tier saves too, staged once (ckpt.job.tiers), so it adds no stall of its own.
    multiple = max(1, round(durable.interval_seconds / local.interval_seconds))
    durable = make_cadence_plan(size_bytes, durable_bw, mtbf_seconds=lost_mtbf,
                        load_seconds=size_bytes / durable_bw, measurement=measurement,
                        interval_seconds=multiple * local.interval_seconds, **options)
    survived_rate = 1.0 / mtbf_seconds - 1.0 / lost_mtbf
    goodput = (1.0 - local.overhead_fraction
               - survived_rate * local.lost_seconds_per_failure
               - durable.lost_seconds_per_failure / lost_mtbf)
    alone = make_cadence_plan(size_bytes, durable_bw, mtbf_seconds=mtbf_seconds,
                      load_seconds=size_bytes / durable_bw, **options)
    return TierCadencePlans(local, durable, max(0.0, goodput), alone.goodput, copies=copies,
                     num_nodes=num_nodes if copies == 2 else None,
                     vulnerable_seconds=window, second_loss_probability=second)
