"""Tests of ``ckpt.storage``."""
