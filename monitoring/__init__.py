"""Monitoring: Prometheus metrics from ckpt/trainer events, a Grafana dashboard, alert rules."""

from monitoring.metrics import Metrics

__all__ = ["Metrics"]
