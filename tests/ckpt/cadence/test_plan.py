"""``ckpt plan``: unit parsers, the plan's numbers, JSON and table output, real bandwidth probes."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from ckpt.cadence import make_cadence_plan, measure_bandwidth
from ckpt.cadence.young_daly import young_daly_interval
from ckpt.cadence.plan import HOST_COPY_BYTES_PER_SECOND
from ckpt.cli._plan import add_cadence_plan_arguments, main, run_cadence_plan
from ckpt.units import parse_bandwidth, parse_size

FIELDS = {
    "size_bytes", "bandwidth_bytes_per_second", "bandwidth_source", "persist_seconds", "stall_seconds",
    "mtbf_seconds", "restart_seconds", "step_seconds", "overhead_budget", "young_daly_seconds",
    "interval_seconds", "interval_steps", "active_bound", "overhead_fraction", "rework_seconds_per_failure",
    "lost_seconds_per_failure", "goodput", "measured_write_bytes_per_second", "measured_read_bytes_per_second",
    "load_seconds",
}


def plan_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("text,num_bytes", [("14GB", 14 * 10**9), ("256MiB", 256 * 2**20), ("1.5 GiB", 1.5 * 2**30),
                                            ("10kb", 10_000), ("7", 7), ("3B", 3), ("2TiB", 2 * 2**40),
                                            ("1e3MB", 10**9)])
def test_parse_size(text, num_bytes):
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["", "GB", "14XB", "-1GB", "14 G B", "1,000MB"])
def test_parse_size_errors(text):
    with pytest.raises(ValueError) as err:
        parse_size(text)
    assert repr(text) in str(err.value) and "GiB" in str(err.value)


def test_parse_bandwidth():
    assert parse_bandwidth("2GB/s") == 2e9
    assert parse_bandwidth("500MiB/s") == 500 * 2**20
    assert parse_bandwidth("1GB") == 1e9
    for bad in ["0GB/s", "fast", "2GB/h", "/s"]:
        with pytest.raises(ValueError, match="invalid bandwidth"):
            parse_bandwidth(bad)


def test_make_plan_hand_computed():
    plan = make_cadence_plan(14 * 10**9, 2e9, mtbf_seconds=86400.0, restart_seconds=60.0,
                             step_seconds=1.2)
    delta = 14e9 / HOST_COPY_BYTES_PER_SECOND  # 1.4 s default stall
    assert plan.stall_seconds == pytest.approx(1.4) == pytest.approx(delta)
    assert plan.persist_seconds == pytest.approx(7.0)
    yd = young_daly_interval(1.4, 86400.0)  # ~490.9 s
    assert plan.young_daly_seconds == pytest.approx(yd)
    assert plan.interval_steps == math.ceil(yd / 1.2) == 410
    tau = 410 * 1.2
    assert plan.interval_seconds == pytest.approx(tau)
    assert plan.active_bound == "young_daly"
    assert plan.overhead_fraction == pytest.approx(1.4 / tau)
    assert plan.rework_seconds_per_failure == pytest.approx((tau + 1.4) / 2 + 7.0)
    assert plan.lost_seconds_per_failure == pytest.approx((tau + 1.4) / 2 + 7.0 + 60.0)
    assert plan.goodput == pytest.approx(1 - 1.4 / tau - ((tau + 1.4) / 2 + 7.0 + 60.0) / 86400.0)


def test_plan_json_fields(capsys):
    out = plan_json(capsys, "--size", "14GB", "--bandwidth", "2GB/s", "--mtbf", "24h", "--step-time", "1.2s",
                    "--stall", "2s", "--restart", "5m")
    assert set(out) == FIELDS
    assert out["size_bytes"] == 14 * 10**9 and out["bandwidth_bytes_per_second"] == 2e9
    assert out["bandwidth_source"] == "given" and out["measured_write_bytes_per_second"] is None
    assert out["stall_seconds"] == 2.0 and out["restart_seconds"] == 300.0 and out["mtbf_seconds"] == 86400.0
    assert out["interval_steps"] == math.ceil(young_daly_interval(2.0, 86400.0) / 1.2)
    assert out["active_bound"] == "young_daly" and 0.98 < out["goodput"] < 1


def test_plan_without_step_time_has_no_steps(capsys):
    out = plan_json(capsys, "--size", "14GB", "--bandwidth", "2GB/s")
    assert out["interval_steps"] is None and out["step_seconds"] is None
    assert out["interval_seconds"] == pytest.approx(young_daly_interval(1.4, 86400.0))


def test_plan_bandwidth_bound(capsys):
    out = plan_json(capsys, "--size", "1TB", "--bandwidth", "100MB/s", "--stall", "1s", "--mtbf", "24h")
    assert out["active_bound"] == "bandwidth"
    assert out["interval_seconds"] == pytest.approx(10000.0) == pytest.approx(out["persist_seconds"])


def test_plan_overhead_budget_bound(capsys):
    out = plan_json(capsys, "--size", "1TB", "--bandwidth", "100GB/s", "--stall", "60s", "--mtbf", "4h",
                    "--overhead-budget", "1%")
    assert out["active_bound"] == "overhead_budget" and out["overhead_budget"] == 0.01
    assert out["interval_seconds"] == pytest.approx(6000.0)
    assert out["overhead_fraction"] == pytest.approx(0.01)
    # The budget buys lower overhead with more lost work: goodput is below the unbounded plan's.
    free = plan_json(capsys, "--size", "1TB", "--bandwidth", "100GB/s", "--stall", "60s", "--mtbf", "4h")
    assert free["active_bound"] == "young_daly" and free["goodput"] > out["goodput"]


def test_plan_table_is_aligned(capsys):
    assert main(["--size", "14GB", "--bandwidth", "2GB/s", "--step-time", "1.2s"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("checkpoint size") and "14.00 GB" in lines[0]
    column = {line.index(line.split("  ", 1)[1].lstrip()) for line in lines}
    assert len(column) == 1, lines
    assert any("= 410 steps" in line for line in lines) and any("young_daly" in line for line in lines)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--size", "14XB", "--bandwidth", "1GB/s"], "invalid size '14XB'"),
        (["--size", "14GB"], "one of the arguments --bandwidth --measure is required"),
        (["--size", "14GB", "--bandwidth", "1GB/s", "--measure", "/tmp/x"], "not allowed with"),
        (["--size", "14GB", "--bandwidth", "1GB/s", "--mtbf", "soon"], "invalid duration 'soon'"),
        (["--size", "14GB", "--bandwidth", "1GB/s", "--overhead-budget", "2"], "invalid overhead budget '2'"),
    ],
)
def test_plan_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_plan_invalid_combination_returns_2(capsys):
    assert main(["--size", "14GB", "--bandwidth", "1GB/s", "--mtbf", "0s"]) == 2
    assert "mtbf" in capsys.readouterr().err


def test_add_plan_arguments_on_a_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="ckpt")
    add_cadence_plan_arguments(parser.add_subparsers(dest="command").add_parser("plan"))
    args = parser.parse_args(["plan", "--size", "1GB", "--bandwidth", "1GB/s", "--json"])
    assert run_cadence_plan(args) == 0
    assert json.loads(capsys.readouterr().out)["persist_seconds"] == 1.0


def test_measure_local_dir_writes_reads_and_cleans_up(tmp_path, capsys):
    target = tmp_path / "probe" / "nested"  # created if missing
    out = plan_json(capsys, "--size", "1GB", "--measure", str(target), "--measure-bytes", "4MiB")
    assert out["bandwidth_source"] == "measured"
    assert out["measured_write_bytes_per_second"] > 0 and out["measured_read_bytes_per_second"] > 0
    assert out["bandwidth_bytes_per_second"] == out["measured_write_bytes_per_second"]
    assert out["persist_seconds"] == pytest.approx(1e9 / out["measured_write_bytes_per_second"])
    assert target.is_dir() and list(target.iterdir()) == []


def test_measure_bandwidth_memory_and_odd_sizes():
    import fsspec

    result = measure_bandwidth("memory://plan-probe", num_bytes=3 * 2**20 + 5, chunk_bytes=2**20)
    assert result.num_bytes == 3 * 2**20 + 5 and result.write_bytes_per_second > 0
    assert fsspec.filesystem("memory").find("/plan-probe") == []
    with pytest.raises(ValueError, match="num_bytes"):
        measure_bandwidth("memory://plan-probe", num_bytes=0)


def test_measure_failure_returns_1(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["--size", "1GB", "--measure", str(blocker / "sub"), "--measure-bytes", "1MiB"]) == 1
    assert "measuring bandwidth" in capsys.readouterr().err


def test_measure_bandwidth_on_every_backend(any_root):
    """Write, read back and delete the probe object on local, file://, memory:// and S3."""
    import fsspec

    url, options = any_root
    result = measure_bandwidth(url, num_bytes=2 * 2**20 + 3, storage_options=options, chunk_bytes=2**20)
    assert result.write_bytes_per_second > 0 and result.read_bytes_per_second > 0
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    assert not fs.exists(path) or fs.find(path) == []


def test_measure_s3_with_endpoint_url(s3_server, s3_root, capsys):
    """The CLI form: credentials from the environment, endpoint from --endpoint-url."""
    out = plan_json(capsys, "--size", "1GB", "--measure", s3_root.url, "--measure-bytes", "6MiB",
                    "--endpoint-url", s3_server.endpoint_url)
    assert out["bandwidth_source"] == "measured" and out["measured_read_bytes_per_second"] > 0
    listed = s3_server.client().list_objects_v2(Bucket=s3_root.bucket, Prefix=s3_root.prefix + "/")
    assert listed.get("KeyCount", 0) == 0


@pytest.mark.parametrize("text,seconds", [("500ms", 0.5), ("30", 30.0), ("30s", 30.0), ("30sec", 30.0),
                                          ("5m", 300.0), ("5min", 300.0), ("1.5h", 5400.0), ("1d", 86400.0),
                                          (" 2 MIN ", 120.0)])
def test_plan_accepts_every_duration_spelling(capsys, text, seconds):
    # The same grammar as checkpoint.interval and CheckpointManager(cadence=...): parse_duration.
    out = plan_json(capsys, "--size", "1GB", "--bandwidth", "1GB/s", "--mtbf", text,
                    "--stall", text, "--restart", text, "--step-time", text)
    assert out["mtbf_seconds"] == out["stall_seconds"] == out["restart_seconds"] == pytest.approx(seconds)
    assert out["step_seconds"] == pytest.approx(seconds)


def test_plan_duration_error_names_value_and_forms(capsys):
    with pytest.raises(SystemExit):
        main(["--size", "1GB", "--bandwidth", "1GB/s", "--restart", "1w"])
    err = capsys.readouterr().err
    assert "invalid duration '1w'" in err and "'30sec'" in err and "'1d'" in err


def test_tier_plans_share_the_stall_and_count_each_tiers_load():
    from ckpt.cadence import make_tier_cadence_plans

    m, m_node = 4 * 3600.0, 48 * 3600.0
    t = make_tier_cadence_plans(10**12, 2e9, 100e9, node_mtbf_seconds=m_node, mtbf_seconds=m,
                        stall_seconds=10.0, step_seconds=5.0)
    # Every durable save falls on a local save's step: one stall for both.
    assert t.durable.interval_steps % t.local.interval_steps == 0
    assert t.durable.active_bound == "given" and t.local.active_bound == "young_daly"
    # A restart reads the checkpoint back from the tier it resumes from.
    assert t.local.load_seconds == pytest.approx(10.0) and t.durable.load_seconds == pytest.approx(500.0)
    assert t.durable.lost_seconds_per_failure == pytest.approx(
        t.durable.rework_seconds_per_failure + 60.0 + 500.0)
    assert t.goodput == pytest.approx(1 - t.local.overhead_fraction
                                      - (1 / m - 1 / m_node) * t.local.lost_seconds_per_failure
                                      - t.durable.lost_seconds_per_failure / m_node)
    assert t.goodput > t.durable_only_goodput + 0.05  # a long durable persist and load
    # A small checkpoint whose cost is the stall: the local tier does not pay.
    small = make_tier_cadence_plans(14 * 10**9, 2e9, 40e9, node_mtbf_seconds=48 * 3600.0,
                            mtbf_seconds=6 * 3600.0, step_seconds=1.2)
    assert small.goodput < small.durable_only_goodput


def test_copies_on_the_next_node_leave_the_durable_tier_the_losses_of_two_neighbours():
    import math

    from ckpt.cadence import make_tier_cadence_plans

    m, m_node = 4 * 3600.0, 48 * 3600.0
    args = (10**12, 2e9, 100e9)
    kw = dict(node_mtbf_seconds=m_node, mtbf_seconds=m, stall_seconds=10.0, step_seconds=5.0)
    one = make_tier_cadence_plans(*args, **kw)
    two = make_tier_cadence_plans(*args, copies=2, num_nodes=16, **kw)
    local = two.local
    assert local == one.local  # the local tier's own plan does not change
    # A node loss takes the local tier down only if one of its 2 neighbours is lost within
    # W = restart + local load + local interval + local persist.
    window = local.restart_seconds + local.load_seconds + local.interval_seconds \
        + local.persist_seconds
    p = 1 - math.exp(-2 * window / (16 * m_node))
    assert two.vulnerable_seconds == pytest.approx(window)
    assert two.second_loss_probability == pytest.approx(p)
    assert two.durable.mtbf_seconds == pytest.approx(m_node / p)
    assert two.durable.interval_seconds > one.durable.interval_seconds  # saved far less often
    assert two.goodput == pytest.approx(1 - local.overhead_fraction
                                        - (1 / m - p / m_node) * local.lost_seconds_per_failure
                                        - two.durable.lost_seconds_per_failure * p / m_node)
    assert two.goodput > one.goodput and two.durable_only_goodput == one.durable_only_goodput
    # Two nodes: each has one neighbour.
    pair = make_tier_cadence_plans(*args, copies=2, num_nodes=2, **kw)
    assert pair.second_loss_probability == pytest.approx(1 - math.exp(-window / (2 * m_node)))
    assert one.copies == 1 and one.second_loss_probability is None


@pytest.mark.parametrize("kw, message", [
    (dict(copies=3, num_nodes=4), "copies=3 is invalid: pass 1 .* or 2"),
    (dict(copies=2), "copies=2 needs the number of nodes"),
    (dict(copies=2, num_nodes=1), "copies=2 needs the number of nodes .* got 1"),
])
def test_tier_plans_refuse_bad_replicas(kw, message):
    from ckpt.cadence import make_tier_cadence_plans

    with pytest.raises(ValueError, match=message):
        make_tier_cadence_plans(10**9, 1e9, 1e10, **kw)
