"""How often to checkpoint: policies, the interval grammar, Young/Daly, ``ckpt plan``.

``policies`` (:class:`CadencePolicy`: every N steps, every T seconds, ``auto``),
``interval`` (the grammar of ``"auto"``, ``"50"``, ``"5m"``), ``young_daly`` (the optimum
and :class:`FailureHistory`, the MTBF's evidence), ``history`` (that evidence kept under a
root, ``_history.json``), ``goodput`` (where the job's wall time went, kept in that history), ``steptime`` (what a background save costs training),
``bandwidth`` (measured storage throughput), ``plan`` (interval advice for one or two
tiers), ``simulate`` (a Monte-Carlo check of the model).
"""

from ckpt.cadence.bandwidth import measure_bandwidth
from ckpt.cadence.goodput import CATEGORIES as GOODPUT_CATEGORIES
from ckpt.cadence.goodput import GoodputLedger
from ckpt.cadence.history import (
    HISTORY_NAME,
    load_goodput,
    load_history,
    load_job_history,
    write_history,
)
from ckpt.cadence.interval import Interval
from ckpt.cadence.plan import (
    CadencePlan,
    TierCadencePlans,
    make_cadence_plan,
    make_tier_cadence_plans,
)
from ckpt.cadence.policies import CadencePolicy, parse_interval
from ckpt.cadence.steptime import StepTimes
from ckpt.cadence.young_daly import FailureHistory

__all__ = [
    "CadencePolicy", "parse_interval", "Interval", "FailureHistory", "HISTORY_NAME",
    "load_history", "load_job_history", "write_history", "GoodputLedger", "GOODPUT_CATEGORIES",
    "load_goodput", "StepTimes", "measure_bandwidth", "CadencePlan", "TierCadencePlans",
    "make_cadence_plan", "make_tier_cadence_plans",
]
