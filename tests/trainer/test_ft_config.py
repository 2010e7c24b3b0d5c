"""The ``[fault_tolerance]`` section: off by default, each group's layout, and the rules that
keep replica groups from giving up on each other too early (one line, naming the key)."""

from __future__ import annotations

import pytest

from tests.e2e._jobs import TINY
from trainer.config import ConfigError, load_config

FT = ["--fault_tolerance.enabled=true", "--parallel.dp_replicate=2",
      "--fault_tolerance.group_id=1"]


def _cfg(*overrides: str):
    return load_config(str(TINY), [*FT, *overrides])


def test_off_by_default_and_nothing_checked_then():
    cfg = load_config(str(TINY), ["--fault_tolerance.group_id=7"])
    assert cfg.fault_tolerance.enabled is False


def test_a_group_is_one_replica_of_the_job_layout():
    cfg = _cfg("--parallel.tp=2").resolved(2 * 2)  # 2 groups of 2 ranks (tp 2)
    par = cfg.parallel
    assert (par.dp, par.dp_replicate, par.dp_shard, par.tp) == (2, 2, 1, 2)
    group = cfg.fault_tolerance.group_layout(par)
    assert (group.dp, group.dp_replicate, group.dp_shard, group.tp) == (1, 1, 1, 2)
    assert group.world_size == 2


def test_the_quorum_timeout_outwaits_a_hung_group():
    cfg = _cfg("--fault.hang_timeout_seconds=100", "--fault_tolerance.heartbeat_timeout_seconds=3")
    assert cfg.quorum_timeout_seconds() == 100 + 3 + 15
    cfg = _cfg("--fault.hang_timeout_seconds=100", "--metrics.port=9109")
    assert cfg.quorum_timeout_seconds() == 100 + 15 + 2 + 15  # the metrics linger too
    assert _cfg("--fault_tolerance.quorum_timeout_seconds=500").quorum_timeout_seconds() == 500


@pytest.mark.parametrize("overrides, key, says", [
    (["--fault_tolerance.group_id=2"], "fault_tolerance.group_id", "use 0 .. 1"),
    (["--fault_tolerance.group_id=-1"], "fault_tolerance.group_id", "is unset"),
    (["--fault_tolerance.min_replicas=3"], "fault_tolerance.min_replicas", "no step"),
    (["--fault.nan_policy=rollback"], "fault.nan_policy", "every replica"),
    (["--checkpoint.root=/tmp/r", "--checkpoint.local_root=/tmp/l"],
     "checkpoint.local_root", "not supported"),
    (["--fault.hang_timeout_seconds=20", "--fault_tolerance.timeout_seconds=30"],
     "fault_tolerance.timeout_seconds", "taken for hung"),
    (["--fault.hang_timeout_seconds=100", "--fault_tolerance.quorum_timeout_seconds=110"],
     "fault_tolerance.quorum_timeout_seconds", "at least"),
    (["--fault_tolerance.lighthouse=localhost:29510"], "fault_tolerance.lighthouse", "http://"),
])
def test_bad_values_are_one_line_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert err.value.key == key and says in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
