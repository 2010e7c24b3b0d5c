"""Tests of ``ckpt.export``."""
