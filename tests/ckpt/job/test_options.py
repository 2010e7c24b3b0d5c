"""The managers' options objects: every field checked where it is defined, each error naming
the field; everyday keywords are the same fields, given once."""

from __future__ import annotations

import inspect

import pytest

import ckpt
from ckpt.job import KeepLast, LocalTierOptions, ManagerOptions


@pytest.mark.parametrize("field, value", [
    ("busy", "later"), ("verify", "sha"), ("max_attempts", 0), ("max_attempts", True),
    ("lease_ttl_seconds", 0), ("retry_backoff_seconds", -1), ("num_threads", 0),
    ("staging_budget_bytes", -5), ("cadence", "every now and then"), ("cadence", 3.5),
    ("retention", "KeepLast(3)"), ("retention", [object()]),
])
def test_a_bad_manager_option_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"ManagerOptions\.{field}"):
        ManagerOptions(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("copies", 3), ("copies", True), ("node_rank", -1), ("cadence", "sometimes"),
])
def test_a_bad_local_tier_option_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"LocalTierOptions\.{field}"):
        LocalTierOptions(**{field: value})


def test_defaults_are_written_once():
    o = ManagerOptions()
    assert (o.busy, o.verify, o.max_attempts, o.async_save, o.use_lease) == \
        ("skip", "full", 3, True, True)
    assert o.lease_ttl_seconds == ckpt.root.DEFAULT_LEASE_TTL_SECONDS \
        == inspect.signature(ckpt.root.Lease).parameters["ttl_seconds"].default
    local = LocalTierOptions()
    assert [type(p) for p in local.retention] == [KeepLast] and local.copies == 1
    # A sequence of policies is kept as a tuple: the options stay frozen.
    assert isinstance(ManagerOptions(retention=[KeepLast(1)]).retention, tuple)


def test_everyday_keywords_are_the_options_fields_given_once(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path / "a"), cadence="5", busy="wait",
                                retention=[]) as mgr:
        assert mgr.options.busy == "wait" and mgr.options.retention == ()
        assert mgr.cadence.describe()["interval_steps"] == 5
    with pytest.raises(ValueError, match="busy given twice"):
        ckpt.CheckpointManager(str(tmp_path / "b"), ManagerOptions(busy="wait"), busy="skip")
    with pytest.raises(ValueError, match="cadence given twice"):
        ckpt.TieredCheckpointManager(str(tmp_path / "c"), str(tmp_path / "d"),
                                     ManagerOptions(cadence="4"), cadence="8")


def test_the_public_entry_points_take_few_parameters():
    assert len(inspect.signature(ckpt.CheckpointManager).parameters) <= 8
    # ckpt.save takes the user's parameters; a manager's per-save choices are a SaveRequest.
    params = inspect.signature(ckpt.save).parameters
    assert len(params) <= 10
    assert not {"lifecycle", "before_commit", "before_write", "save_id", "cost", "plan_cache",
                "durable", "resolved", "span", "host_window_bytes"} & set(params)
