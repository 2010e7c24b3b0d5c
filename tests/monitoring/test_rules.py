"""The shipped alert rules and dashboard, checked without a running server: promtool's rule
check and unit tests, a runbook entry per alert, every alert name the docs, the config
help and the exporter's help mention being a shipped alert, and every dashboard query
reading only metrics the exporter defines, the rules record or dcgm-exporter serves (and
every exporter metric on a panel)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from monitoring import Metrics
from trainer.config import field_docs

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "monitoring" / "prometheus"
ALERTS = PROM / "alerts.yml"
RULE_TESTS = PROM / "alerts_test.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboard.json"
DOCS = ROOT / "docs" / "monitoring.md"
DCGM_FIXTURE = ROOT / "tests" / "monitoring" / "fixtures" / "dcgm_exporter.prom"
# The exporter's names; a recording rule's (level:name) is not one of them.
_NAME = re.compile(r"(?<![\w:])((?:ckpt|train)_[a-z0-9_]+)(?![\w:])")
_RECORDED = re.compile(r"\b([a-z_]+:[a-z0-9_:]+)\b")
_DCGM = re.compile(r"\b(DCGM_FI_[A-Z0-9_]+)\b")
# An alert name is CamelCase; the words that say a sentence speaks of alerts.
_CAMEL = re.compile(r"(?<![\w.])([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+)(?![\w(])")
_ALERT_WORDS = re.compile(r"(?<![\w-])(?:alerts?|alerting|fires?|fired|firing|runbook)(?![\w-])",
                          re.I)
_SENTENCE_END = re.compile(r"(?<=[.;!?])\s+")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed; scripts/test.sh installs Debian's "
                        "'prometheus' as root")
        pytest.skip("promtool not installed (sudo apt-get install prometheus)")
    return path


# The rule files are read with regular expressions (no YAML library among the project's
# dependencies); promtool, which parses them for real, checks them first.
def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)$", ALERTS.read_text(), re.M)


def alert_rules() -> dict[str, str]:
    """{alert name: its rule text (expr, labels, annotations)}."""
    parts = re.split(r"^\s*- alert: (\w+)$", ALERTS.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def recorded_names() -> set[str]:
    """The series the shipped recording rules make."""
    return set(re.findall(r"^\s*- record: (\S+)$", ALERTS.read_text(), re.M))


def dcgm_names() -> set[str]:
    """dcgm-exporter's metric names, from the recorded exposition the tests serve."""
    return set(re.findall(r"^# TYPE (DCGM_\w+) ", DCGM_FIXTURE.read_text(), re.M))


def exporter_series() -> dict[str, str]:
    """{sample name: family name} of everything the exporter serves."""
    out = {}
    for fam in Metrics().registry.collect():
        for s in fam.samples:
            out[s.name] = fam.name
    return out


def test_promtool_accepts_alert_rules():
    out = subprocess.run([_promtool(), "check", "rules", str(ALERTS)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_pass_and_cover_every_alert():
    out = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=PROM,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    fired = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels",
                           RULE_TESTS.read_text()))
    assert set(alert_names()) <= fired, f"alerts without a firing test: " \
        f"{sorted(set(alert_names()) - fired)}"


def test_every_alert_has_a_runbook_entry():
    text = DOCS.read_text()
    for name in alert_names():
        section = re.search(rf"^### {name}\n(.*?)(?=^##)", text, re.S | re.M)
        assert section, f"docs/monitoring.md: no '### {name}' runbook section"
        body = section.group(1)
        assert "**First:**" in body and "`ckpt " in body, f"{name}: runbook needs a first " \
            f"action and a ckpt command"
    for name, rule in alert_rules().items():
        assert f'runbook: "docs/monitoring.md#{name.lower()}"' in rule, name


def test_every_exporter_metric_and_collective_kind_is_in_the_docs_tables():
    """docs/monitoring.md documents each series the exporter serves in a table row (the
    metrics table, or the table of its section), and each kind of collective."""
    from ckpt.events import COMM_KINDS

    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    families = {fam.name for fam in Metrics().registry.collect()}
    undocumented = sorted(f for f in families if not any(f"`{f}" in row for row in rows))
    assert not undocumented, f"docs/monitoring.md: no table row for {undocumented}"
    kinds = [k for k in COMM_KINDS if not any(row.startswith(f"| `{k}` |") for row in rows)]
    assert not kinds, f"docs/monitoring.md: the collectives' table lacks the kinds {kinds}"


def alert_mentions(text: str) -> set[str]:
    """CamelCase names that ``text`` (markdown or a help string) uses as alert names: in a
    sentence that speaks of alerts (alert, fires, firing, runbook ...), in a
    table column headed so (``| Alert |``), or as a heading under ``## Runbook``. Fenced code
    is skipped."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    section = ""
    for line in text.splitlines():
        if m := re.match(r"^## (.+)$", line):
            section = m.group(1).strip()
        elif (m := re.match(r"^###+ (\w+)\s*$", line)) and section == "Runbook":
            found.update(_CAMEL.findall(m.group(1)))
    for para in re.split(r"\n\s*\n", text):
        lines = para.strip().splitlines()
        if lines and lines[0].startswith("|"):  # a table: each row apart
            rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
            columns = [i for i, head in enumerate(rows[0]) if _ALERT_WORDS.search(head)]
            for row in rows[2:]:
                found.update(n for i in columns if i < len(row) for n in _CAMEL.findall(row[i]))
            units = [" ".join(row) for row in rows]
        else:
            units = _SENTENCE_END.split(" ".join(para.split()))
        for unit in units:
            if _ALERT_WORDS.search(unit):
                found.update(_CAMEL.findall(unit))
    return found


def mention_sources() -> list[tuple[str, str]]:
    """``(where, text)`` of everything that names alerts for an operator: docs/*.md and the
    README, each config key's help (docs/config.md is generated from it), and the help of
    each exporter metric."""
    out = [(str(p.relative_to(ROOT)), p.read_text())
           for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]]
    out += [(f"config help of {key}", help_) for key, _, _, help_ in field_docs()]
    out += [(f"help of metric {fam.name}", fam.documentation)
            for fam in Metrics().registry.collect()]
    return out


def test_every_alert_name_mentioned_is_a_shipped_alert():
    shipped = set(alert_names())
    wrong, seen = [], set()
    for where, text in mention_sources():
        names = alert_mentions(text)
        seen |= names
        wrong += [f"{where}: {name}" for name in sorted(names - shipped)]
    assert not wrong, f"alert names that monitoring/prometheus/alerts.yml does not define " \
        f"(its alerts: {', '.join(sorted(shipped))}); use the rule's name: {wrong}"
    assert shipped <= seen, f"alerts the docs never name: {sorted(shipped - seen)}"


def test_alert_mentions_are_told_from_other_names():
    """The check above sees a wrong name in each place one is written, and no class name
    in a sentence that is not about alerts."""
    assert alert_mentions("Quorum size below which FtQuorumBelowMinimum fires; 0 = off.") \
        == {"FtQuorumBelowMinimum"}
    assert alert_mentions("A save raises CheckpointNotFoundError. `ReplicaLost` fires "
                          "when a group is gone.") == {"ReplicaLost"}
    assert alert_mentions("| Alert | Fault |\n|---|---|\n| TrainingJobGone | a kill |\n") \
        == {"TrainingJobGone"}
    assert alert_mentions("## Runbook\n\n### TrainingJobGone\nThe job is gone.\n\n## Next\n"
                          "### CheckpointManager\nIts class.\n") == {"TrainingJobGone"}
    assert alert_mentions("The CheckpointManager page-locks buffers, fire-and-forget; "
                          "a DeviceMesh lays out ranks.\n```\n# fires CkptWriter\n```\n") \
        == set()


def test_dashboard_queries_read_only_exporter_metrics_and_cover_them_all():
    series = exporter_series()
    used_families = set()
    exprs = dashboard_exprs()
    assert exprs and all(e.strip() for e in exprs), "empty panel query"
    recorded, dcgm = recorded_names(), dcgm_names()
    for expr in exprs:
        names = _NAME.findall(expr)
        assert names or _RECORDED.findall(expr), f"panel query reads no exporter metric: {expr}"
        for name in names:
            assert name in series, f"panel query reads unknown metric {name!r}: {expr}"
            used_families.add(series[name])
        for name in _RECORDED.findall(expr):
            assert name in recorded, f"panel query reads a series no rule records: {name!r}"
    families = set(series.values())
    assert families <= used_families, f"metrics on no panel: {sorted(families - used_families)}"
    # Alert and recording rules, likewise, read only what the exporter defines, what a rule
    # records and what dcgm-exporter serves.
    for name in _NAME.findall(ALERTS.read_text()):
        assert name in series, f"alerts.yml reads unknown metric {name!r}"
    for name in _RECORDED.findall(re.sub(r"#.*", "", ALERTS.read_text())):
        assert name in recorded, f"alerts.yml reads a series no rule records: {name!r}"
    for name in _DCGM.findall(re.sub(r"#.*", "", ALERTS.read_text())):
        assert name in dcgm, f"alerts.yml reads {name!r}, which dcgm-exporter does not serve"


def tiered_series() -> set[str]:
    """Sample names of the series with a ``tier`` label (both checkpoint tiers feed them)."""
    return {s.name for fam in Metrics().registry.collect() for s in fam.samples
            if "tier" in s.labels}


def test_alerts_read_the_durable_tier_only():
    """Every alert that reads a series with a ``tier`` label selects ``tier="durable"``: the
    local tier's saves never page, nor hide a durable tier that stopped committing."""
    tiered = tiered_series()
    assert {"ckpt_saves_total", "ckpt_save_stall_seconds_bucket", "ckpt_last_committed_step",
            "ckpt_last_commit_timestamp_seconds"} <= tiered
    read = set()
    for alert, rule in alert_rules().items():
        for m in re.finditer(r"\b([a-z_]+)(\{[^}]*\})?", rule):
            if m.group(1) in tiered:
                read.add(m.group(1))
                assert 'tier="durable"' in (m.group(2) or ""), \
                    f"{alert} reads {m.group(1)} without tier=\"durable\""
    assert read, "no alert reads a tiered series"


def test_structural_check_rejects_unknown_and_empty_queries(tmp_path, monkeypatch):
    """The check above fails on a typo'd metric and on a panel without a metric."""
    good = json.loads(DASHBOARD.read_text())
    for bad_expr in ('max(ckpt_last_comitted_step{job=~"$job"})', "  ", "time()"):
        doc = json.loads(json.dumps(good))
        doc["panels"][0]["targets"][0]["expr"] = bad_expr
        path = tmp_path / "dashboard.json"
        path.write_text(json.dumps(doc))
        monkeypatch.setitem(globals(), "DASHBOARD", path)
        with pytest.raises(AssertionError):
            test_dashboard_queries_read_only_exporter_metrics_and_cover_them_all()
