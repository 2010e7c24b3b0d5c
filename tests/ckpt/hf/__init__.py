"""Tests of ``ckpt.hf``."""
