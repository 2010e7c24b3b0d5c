"""Tests of ``ckpt.ranks``."""
