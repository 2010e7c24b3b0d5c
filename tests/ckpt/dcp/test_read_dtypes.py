"""No dtype crashes a read, at any item offset, through any read path.

Items are packed without padding, so an item can start at any byte of a data file. A view of
the file's bytes at such an offset is a misaligned tensor, and copying from a misaligned
complex128 view crashes the process (SIGSEGV). Here every dtype of the format lands at
offsets 1, 3, 8 and 0 modulo 16, through each read path: the same-layout local load, a
resharding load (2 ranks save DTensor halves, 1 process loads whole tensors), memory:// and
S3, and a whole-tensor save loaded into DTensor row shards on 2 ranks. Each load runs in a child process so that a crash fails the test instead of pytest.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.ckpt.dcp._dtype_child import NUMEL as _NUMEL
from tests.dist import run_ranks

ROOT = Path(__file__).resolve().parents[3]


def _run_child(kind: str, root: str, options: dict | None = None) -> str:
    argv = [sys.executable, "-m", "tests.ckpt.dcp._dtype_child", kind, root]
    if options is not None:
        argv.append(json.dumps(options))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"{kind}: the load crashed the process with {name}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, f"{kind}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    line = proc.stdout.strip().splitlines()[-1]
    _, num_items, num_misaligned = line.split()
    # The property is only tested if items really sit at misaligned offsets.
    assert int(num_misaligned) >= 20, line
    return line


def test_same_layout_local(tmp_path):
    _run_child("local", str(tmp_path / "root"))


def test_memory():
    _run_child("memory", f"memory://ckpt-dtypes/{uuid.uuid4().hex[:12]}")


def test_s3(s3_root):
    _run_child("s3", s3_root.url, s3_root.storage_options)


def _save_sharded(rank: int, world: int, root: str) -> None:
    from tests.ckpt.dcp._dtype_child import save_sharded

    save_sharded(rank, world, root)


def test_resharding_load(tmp_path):
    """2 ranks save column halves; one process loads whole tensors (strided slices)."""
    root = str(tmp_path / "root")
    run_ranks(_save_sharded, 2, root, timeout=120)
    _run_child("reshard", root)


def _load_into_shards(rank: int, world: int, root: str) -> str:
    from tests.ckpt.dcp._dtype_child import load_into_shards

    return load_into_shards(rank, world, root)


def test_whole_save_into_sharded_target(tmp_path):
    """One process saves whole tensors; 2 ranks load row shards of them (DTensor targets).

    The ranks are child processes: a crash shows up as a rank that died without a result.
    """
    import ckpt
    from tests.ckpt.dcp._dtype_child import plain_state

    root = str(tmp_path / "root")
    ckpt.save(plain_state(_NUMEL), root, 1, num_threads=1)
    assert run_ranks(_load_into_shards, 2, root, timeout=120) == ["OK", "OK"]


def test_every_format_dtype_is_covered():
    from ckpt.format import dtype_from_name
    from tests.ckpt.dcp._dtype_child import FORMAT_DTYPES, cases

    names = {"complex128", "complex64", "float64", "bfloat16", "bool", "uint8"}
    assert {dtype_from_name(n, "test") for n in names} <= set(FORMAT_DTYPES)
    assert {d for _, d, _ in cases()} == set(FORMAT_DTYPES)
