"""Monitoring: Prometheus metrics from ckpt/trainer events, a Grafana dashboard, alert rules."""

from monitoring.metrics import Metrics, local_port

__all__ = ["Metrics", "local_port"]
