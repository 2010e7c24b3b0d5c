"""Tests of ``ckpt.format``."""
