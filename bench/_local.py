"""Local-disk contenders: our save/load against torch.save, DCP and the physical floors.

Three phases per state size, each interleaved on its own (see ``_common.interleave``):

* **steady**: one long-lived ``CheckpointManager`` (async, buffers already allocated by an
  untimed first save) against the copy floor (copying the state into the manager's own
  staging buffers: exactly the destination its stall writes to), torch.save + fsync,
  ``dcp.save`` with 1/2/4 threads, ``dcp.async_save`` and raw buffered writes + fsync (one
  file, and N files in N threads: the floor is the faster of the two, round by round).
* **first**: a fresh manager per sample (with and without ``prepare``) against a copy into
  separately preallocated buffers.
* **load**: our load with verify full/size/none, ``dcp.load``, ``torch.load`` and raw reads,
  with a cold page cache (dropped before each sample, when allowed) and a warm one.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import (
    Contender,
    byte_view,
    drop_page_cache,
    interleave,
    now,
    rmtree,
    scrub_cpu_caches,
    tensors_of,
)

warnings.filterwarnings("ignore", message=".*assuming the intent is")
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
logging.getLogger("ckpt").setLevel(logging.ERROR)


def _balance(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[] for _ in range(n)]
    totals = [0] * n
    for t in sorted(tensors, key=lambda t: -t.numel() * t.element_size()):
        k = totals.index(min(totals))
        buckets[k].append(t)
        totals[k] += t.numel() * t.element_size()
    return [b for b in buckets if b]


def _timed_per_bucket(one, n: int) -> float:
    """Seconds to run ``one(k)`` for every bucket ``k``, one thread per bucket."""
    t0 = now()
    if n == 1:
        one(0)
    else:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n)))
    return now() - t0


def raw_write(path_prefix: str, buckets: list[list[torch.Tensor]], crc: bool = False) -> float:
    """Write each bucket to its own file (one thread each), fsync every file; seconds.

    With ``crc``, each thread first takes the crc32c of every tensor it writes (ckpt's own
    ``crc32c_of``), as a floor for a save that checksums."""
    from ckpt.format import crc32c_of

    def one(k: int) -> None:
        if crc:
            for t in buckets[k]:
                crc32c_of([byte_view(t)])
        with open(f"{path_prefix}.{k}", "wb", buffering=0) as f:
            for t in buckets[k]:
                f.write(byte_view(t))
            os.fsync(f.fileno())

    return _timed_per_bucket(one, len(buckets))


def raw_read(path_prefix: str, buckets: list[list[torch.Tensor]]) -> float:
    """Read the files of :func:`raw_write` back into the tensors' own memory; seconds."""
    def one(k: int) -> None:
        with open(f"{path_prefix}.{k}", "rb", buffering=0) as f:
            for t in buckets[k]:
                view = byte_view(t)
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise EOFError(f"{path_prefix}.{k} is short")
                    got += n

    return _timed_per_bucket(one, len(buckets))


def _unlink(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def _rm_prefix(prefix: str) -> None:
    d, base = os.path.split(prefix)
    for name in os.listdir(d):
        if name.startswith(os.path.basename(base) + "."):
            os.unlink(os.path.join(d, name))


def _manager(root: str, num_threads: int):
    from ckpt.job import CheckpointManager, KeepLast, ManagerOptions

    mgr = CheckpointManager(root, ManagerOptions(num_threads=num_threads), retention=[KeepLast(1)])
    marks: dict[int, float] = {}
    staged: dict[int, float] = {}

    def on_event(ev) -> None:
        if ev.kind == "save_committed":
            marks[ev.step] = now()
        elif ev.kind == "save_staged":
            staged[ev.step] = float(ev.fields.get("stall_seconds", 0.0))

    mgr.events.subscribe(on_event)
    return mgr, marks, staged


class _OursSave:
    """Samples of one long-lived manager: stall, time to commit, time until wait() returns."""

    def __init__(self, root: str, state: dict, num_threads: int):
        self.state = state
        self.mgr, self.marks, self.staged = _manager(root, num_threads)
        self.step = 0
        t0 = now()
        self.save_once()
        self.warmup_seconds = now() - t0

    def save_once(self) -> dict[str, float]:
        self.step += 1
        t0 = now()
        if not self.mgr.save(self.step, self.state):
            raise RuntimeError(f"save of step {self.step} was not started")
        t1 = now()
        self.mgr.wait()
        t2 = now()
        if self.step not in self.marks:
            raise RuntimeError(f"step {self.step} was not committed")
        return {"stall": t1 - t0, "stage": self.staged.get(self.step, float("nan")),
                "commit": self.marks[self.step] - t0, "wait": t2 - t0}

    def staging_buffers(self) -> list[torch.Tensor]:
        return list(self.mgr.staging._buffers.values())  # private: the bench's floor target

    def close(self) -> None:
        self.mgr.close()


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    t0 = now()
    for d, s in zip(dst, src):
        d.copy_(s)
    return now() - t0


def _first_save(root: str, state: dict, num_threads: int, prepare: bool) -> float:
    mgr, _, _ = _manager(root, num_threads)
    try:
        if prepare:
            mgr.prepare(state)
        t0 = now()
        mgr.save(1, state)
        stall = now() - t0
        mgr.wait()
        return stall
    finally:
        mgr.close()
        del mgr
        gc.collect()


def steady_phase(state: dict, work: str, repeats: int, opts, log) -> dict[str, Any]:
    src = tensors_of(state)
    ours = _OursSave(os.path.join(work, "ours_steady"), state, opts.threads)
    info: dict[str, Any] = {"ours_warmup_save_seconds": ours.warmup_seconds}
    dst = ours.staging_buffers()
    if [tuple(t.shape) for t in dst] != [tuple(t.shape) for t in src]:
        log("  (staging buffers do not line up with the state: copy floor uses new buffers)")
        dst = [torch.empty_like(t).copy_(t) for t in src]
        info["copy_floor_target"] = "separate buffers"
    else:
        info["copy_floor_target"] = "the manager's staging buffers"
    raw_prefix = os.path.join(work, "raw")
    one_bucket = [list(src)]
    n_buckets = _balance(src, opts.threads)
    step = [0]

    def torch_save() -> float:
        t0 = now()
        with open(os.path.join(work, "torch_save.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return now() - t0

    def dcp_save(k: int):
        def run() -> float:
            t0 = now()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(
                os.path.join(work, f"dcp{k}"), thread_count=k, sync_files=True), no_dist=True)
            return now() - t0
        return run

    def dcp_async() -> dict[str, float]:
        step[0] += 1
        writer = dcp.FileSystemWriter(os.path.join(work, "dcp_async"),
                                      thread_count=opts.dcp_async_threads, sync_files=True)
        t0 = now()
        fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
        t1 = now()
        fut.result()
        return {"stall": t1 - t0, "total": now() - t0}

    contenders = [
        Contender("copy_floor", lambda: _copy_into(dst, src)),
        Contender("ours", ours.save_once),
        Contender("torch_save", torch_save,
                  after=lambda: _unlink(os.path.join(work, "torch_save.pt"))),
        *[Contender(f"dcp_save_t{k}", dcp_save(k),
                    after=(lambda k=k: rmtree(os.path.join(work, f"dcp{k}"))))
          for k in opts.dcp_threads],
        Contender("dcp_async", dcp_async, after=lambda: rmtree(os.path.join(work, "dcp_async"))),
        Contender("raw_write_1", lambda: raw_write(raw_prefix, one_bucket),
                  after=lambda: _rm_prefix(raw_prefix)),
        Contender(f"raw_write_{len(n_buckets)}", lambda: raw_write(raw_prefix, n_buckets),
                  after=lambda: _rm_prefix(raw_prefix)),
        Contender(f"raw_write_crc_{len(n_buckets)}",
                  lambda: raw_write(raw_prefix, n_buckets, crc=True),
                  after=lambda: _rm_prefix(raw_prefix)),
    ]
    try:
        series = interleave(contenders, repeats, log=log, before_each=scrub_cpu_caches)
    finally:
        ours.close()
        dst.clear()
        rmtree(os.path.join(work, "ours_steady"))
    info["errors"] = {c.name: c.error for c in contenders if c.error}
    info["raw_write_files"] = len(n_buckets)
    return {"series": series, "info": info}


def first_phase(state: dict, work: str, repeats: int, opts, log) -> dict[str, Any]:
    src = tensors_of(state)
    dst = [torch.empty_like(t) for t in src]
    _copy_into(dst, src)  # fault the pages in: a floor copies into ready buffers
    n = [0]

    def first(prepare: bool):
        def run() -> float:
            n[0] += 1
            return _first_save(os.path.join(work, f"first{n[0]}"), state, opts.threads, prepare)
        return run

    def cleanup() -> None:
        for name in os.listdir(work):
            if name.startswith("first"):
                rmtree(os.path.join(work, name))

    contenders = [
        Contender("copy_floor", lambda: _copy_into(dst, src)),
        Contender("ours_first", first(False), after=cleanup),
        Contender("ours_first_prepared", first(True), after=cleanup),
    ]
    series = interleave(contenders, repeats, log=log, before_each=scrub_cpu_caches)
    dst.clear()
    return {"series": series, "info": {"errors": {c.name: c.error for c in contenders
                                                  if c.error}}}


def load_phase(state: dict, work: str, repeats: int, opts, log) -> dict[str, Any]:
    """Write one checkpoint per format (untimed), then time loads into the live state."""
    from ckpt.dcp import api

    src = tensors_of(state)
    ours_root = os.path.join(work, "ours_load")
    api.save(state, ours_root, 1, num_threads=opts.threads)
    dcp_dir = os.path.join(work, "dcp_load")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir, thread_count=opts.threads),
             no_dist=True)
    pt = os.path.join(work, "load.pt")
    with open(pt, "wb") as f:
        torch.save(state, f)
    raw1, rawn = os.path.join(work, "raw1"), os.path.join(work, "rawn")
    one_bucket, n_buckets = [list(src)], _balance(src, opts.threads)
    raw_write(raw1, one_bucket)
    raw_write(rawn, n_buckets)

    def ours(verify: str):
        return lambda: _timed(lambda: api.load(state, ours_root, 1, verify=verify,
                                               num_threads=opts.threads))

    def torch_load() -> float:
        t0 = now()
        loaded = torch.load(pt, weights_only=True, mmap=False)
        t = now() - t0
        del loaded
        return t

    contenders = [
        Contender("ours_full", ours("full")),
        Contender("ours_size", ours("size")),
        Contender("ours_none", ours("none")),
        Contender("dcp_load", lambda: _timed(lambda: dcp.load(
            state, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True))),
        Contender("torch_load", torch_load),
        Contender("raw_read_1", lambda: raw_read(raw1, one_bucket)),
        Contender(f"raw_read_{len(n_buckets)}", lambda: raw_read(rawn, n_buckets)),
    ]
    out: dict[str, Any] = {"info": {"raw_read_files": len(n_buckets)}}
    try:
        for mode in opts.cache_modes:
            if mode == "cold":
                if not drop_page_cache():
                    log("  page cache cannot be dropped here: cold-cache loads skipped")
                    out["info"]["cold"] = "not allowed (no permission to drop the page cache)"
                    continue
                log("  loads, cold page cache (dropped before every sample)")
                out["cold"] = interleave(contenders, repeats, log=log,
                                         before_each=drop_page_cache)
            else:
                log("  loads, warm page cache")
                out["warm"] = interleave(contenders, repeats, log=log,
                                         before_each=scrub_cpu_caches)
    finally:
        for p in (ours_root, dcp_dir):
            rmtree(p)
        for p in (raw1, rawn):
            _rm_prefix(p)
        _unlink(pt)
    out["info"]["errors"] = {c.name: c.error for c in contenders if c.error}
    return out


def _timed(fn) -> float:
    t0 = now()
    fn()
    return now() - t0


def run_local(state: dict, work: str, repeats: int, opts, log) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, fn in (("steady", steady_phase), ("first", first_phase), ("load", load_phase)):
        log(f" local/{name}")
        try:
            res[name] = fn(state, work, repeats, opts, log)
        except Exception as exc:  # noqa: BLE001 - one phase must not stop the others
            import traceback

            log(f"  ! phase {name} failed: {exc}\n{traceback.format_exc()}")
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
    return res


__all__ = ["run_local", "raw_write", "raw_read"]
