"""Tests of ``ckpt.job``."""
