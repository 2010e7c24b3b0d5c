"""Tests of ``ckpt.dcp``."""
