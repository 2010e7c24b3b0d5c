"""Tests of ``ckpt.root``."""
