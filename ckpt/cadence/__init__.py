"""How often to checkpoint: policies, the interval grammar, Young/Daly, ``ckpt plan``.

``policies`` (:class:`CadencePolicy`: every N steps, every T seconds, ``auto``),
``interval`` (the grammar of ``"auto"``, ``"50"``, ``"5m"``), ``young_daly`` (the optimum
and :class:`FailureHistory`, the MTBF's evidence), ``history`` (that evidence kept under a
root, ``_history.json``), ``goodput`` (where the job's wall time went, kept in that history), ``steptime`` (what a background save costs training),
``bandwidth`` (measured storage throughput), ``plan`` (interval advice for one or two
tiers), ``simulate`` (a Monte-Carlo check of the model).
"""

from ckpt.cadence.bandwidth import BandwidthMeasurement, measure_bandwidth
from ckpt.cadence.goodput import CATEGORIES as GOODPUT_CATEGORIES
from ckpt.cadence.goodput import GoodputLedger
from ckpt.cadence.history import (
    HISTORY_NAME,
    load_goodput,
    load_history,
    load_job_history,
    read_history,
    write_history,
)
from ckpt.cadence.interval import INTERVAL_FORMS, Interval
from ckpt.cadence.plan import Plan, TierPlans, make_plan, make_tier_plans
from ckpt.cadence.policies import (
    Auto,
    CadenceBase,
    CadencePolicy,
    EverySeconds,
    EverySteps,
    parse_interval,
)
from ckpt.cadence.steptime import StepTimes
from ckpt.cadence.young_daly import FailureHistory, optimal_interval, young_daly_interval

__all__ = [
    "CadencePolicy", "CadenceBase", "EverySteps", "EverySeconds", "Auto", "parse_interval",
    "Interval", "INTERVAL_FORMS",
    "FailureHistory", "optimal_interval", "young_daly_interval",
    "HISTORY_NAME", "load_history", "load_job_history", "read_history", "write_history",
    "GoodputLedger", "GOODPUT_CATEGORIES", "load_goodput",
    "StepTimes", "BandwidthMeasurement", "measure_bandwidth",
    "Plan", "TierPlans", "make_plan", "make_tier_plans",
]
