"""Tests of ``ckpt.cadence``."""
