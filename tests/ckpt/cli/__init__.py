"""Tests of ``ckpt.cli``."""
