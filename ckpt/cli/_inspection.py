"""Read-only looks into a checkpoint root for operators: one checkpoint, two compared, the
job's failure history. The ``ckpt show``, ``ckpt diff`` and ``ckpt history`` commands print
what these functions return; each result is JSON-safe.

Nothing here writes, and nothing is allocated on a manifest's word alone: ``diff`` reads
one chunk at a time in blocks of at most ``BLOCK_BYTES`` when both checkpoints chunk a
tensor alike (the common case: same layout), and assembles whole tensors only when they do
not, up to ``max_tensor_bytes`` each. Every byte read is checked against its crc32c.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ckpt.cadence import HISTORY_NAME, load_history
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, crc_mismatch_error
from ckpt.format import (
    ItemLocation,
    Manifest,
    crc32c_of,
    decode_object,
    dtype_from_name,
    is_packed,
    step_dirname,
    step_file,
)
from ckpt.root import COMMITTED, CheckpointStore, read_lease

__all__ = ["Selected", "select", "show", "diff", "history", "FINGERPRINT_KEY", "BLOCK_BYTES",
           "DEFAULT_MAX_TENSOR_BYTES"]

FINGERPRINT_KEY = "trainer.fingerprint"
"""Where the trainer keeps its config fingerprint (a non-tensor value of the state)."""
BLOCK_BYTES = 16 << 20
"""The most bytes ``diff`` holds per side while comparing chunks of the same shape."""
DEFAULT_MAX_TENSOR_BYTES = 1 << 30
"""The largest tensor ``diff`` assembles whole (when the two chunkings differ)."""

Progress = Callable[[int, int], None]


@dataclass
class Selected:
    """One version of one step, chosen by step (its committed version) or by id (any)."""

    manifest: Manifest
    status: str

    def label(self) -> str:
        return f"step {self.manifest.step} (id {self.manifest.save_id})"


def select(store: CheckpointStore, step: int | None = None, save_id: str | None = None
           ) -> Selected:
    """The committed checkpoint of ``step``, or the version ``save_id`` whatever its status
    (a rolled-back one too), with every part read (its manifest is complete). Raises
    ``CheckpointNotFoundError`` / ``CorruptCheckpointError``."""
    if save_id is not None:
        entry = store.life.find(save_id)
        if entry.manifest is None:
            raise CheckpointNotFoundError(
                f"id {save_id} (step {entry.step}) is {entry.status}: {entry.problem}")
        return Selected(store.complete(entry.manifest), entry.status)
    if step is None:
        committed = store.committed_steps()
        if not committed:
            raise CheckpointNotFoundError(f"no committed checkpoint under {store.storage.url}")
        step = committed[-1]
    return Selected(store.read_manifest(step, complete=True), COMMITTED)


def _numel_bytes(t: dict[str, Any], fqn: str) -> int:
    itemsize = torch.empty((), dtype=dtype_from_name(t["dtype"], fqn)).element_size()
    return math.prod(t["shape"]) * itemsize


def _iso(unix: float | None) -> str | None:
    if not isinstance(unix, (int, float)) or not math.isfinite(unix):
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))
    except (OverflowError, OSError, ValueError):
        return None


def _read_item(store: CheckpointStore, m: Manifest, loc: ItemLocation, start: int = 0,
               end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` of one item (relative to the item); size-checked."""
    end = loc.length if end is None else end
    rel = step_file(m.step, loc.file)
    data = store.storage.read_bytes(rel, loc.offset + start, loc.offset + end)
    if len(data) != end - start:
        where = store.storage.describe(rel)
        raise CorruptCheckpointError(
            f"{where} is shorter than its manifest says (wanted bytes [{loc.offset + start}, "
            f"{loc.offset + end})); the file is truncated. Load an earlier step.", path=where)
    return data


def _crc_failed(store: CheckpointStore, m: Manifest, loc: ItemLocation, crc: int
                ) -> CorruptCheckpointError:
    where = store.storage.describe(step_file(m.step, loc.file))
    return crc_mismatch_error(where, loc.crc32c, crc, span=(loc.offset, loc.offset + loc.length))


def _object_bytes(store: CheckpointStore, m: Manifest, fqn: str) -> bytes:
    loc = m.objects[fqn]
    data = _read_item(store, m, loc)
    crc = crc32c_of([data])
    if crc != loc.crc32c:
        raise _crc_failed(store, m, loc, crc)
    return data


def _decode(store: CheckpointStore, m: Manifest, fqn: str, data: bytes) -> Any:
    return decode_object(data, f"{store.storage.describe(step_dirname(m.step))} {fqn}")


def _read_object(store: CheckpointStore, m: Manifest, fqn: str) -> Any:
    return _decode(store, m, fqn, _object_bytes(store, m, fqn))


# -- show ----------------------------------------------------------------------------------
def show(store: CheckpointStore, sel: Selected, *, with_tensors: bool = False
         ) -> dict[str, Any]:
    """Everything a checkpoint's manifest says about it, plus the trainer's config
    fingerprint when the state holds one (the only data read besides the manifest)."""
    m = sel.manifest
    tensors = {fqn: {"shape": list(t["shape"]), "dtype": t["dtype"],
                     "bytes": _numel_bytes(t, fqn), "num_chunks": len(t["chunks"])}
               for fqn, t in m.tensors.items()}
    fingerprint = _read_object(store, m, FINGERPRINT_KEY) if FINGERPRINT_KEY in m.objects \
        else None
    out: dict[str, Any] = {
        "step": m.step, "id": m.save_id, "status": sel.status,
        "url": store.storage.describe(step_dirname(m.step)),
        "created": _iso(m.created_unix), "created_unix": m.created_unix,
        "format_version": m.format_version,
        "world_size": m.world_size, "layout": m.layout,
        # One node's share of a job-wide checkpoint (a node-local version), or None.
        "span": m.span.to_json() if m.span is not None else None,
        "share": m.span.describe() if m.span is not None else None,
        "num_tensors": len(tensors),
        "tensor_bytes": sum(t["bytes"] for t in tensors.values()),
        "num_objects": len(m.objects),
        "num_files": len(m.files), "total_bytes": m.total_bytes,
        "config_fingerprint": fingerprint if isinstance(fingerprint, str) else None,
        "user_metadata": m.user_metadata,
        "writer": m.writer, "versions": m.versions,
    }
    if with_tensors:
        out["tensors"] = tensors
    return out


# -- diff ----------------------------------------------------------------------------------
def _chunk_keys(t: dict[str, Any]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c["offsets"]), tuple(c["sizes"])) for c in t["chunks"])


def _blocks(store: CheckpointStore, m: Manifest, loc: ItemLocation, block: int
            ) -> Iterator[bytes]:
    """The item's bytes in blocks of ``block``; its crc32c is checked after the last."""
    crc, start = 0, 0
    while start < loc.length:
        end = min(loc.length, start + block)
        data = _read_item(store, m, loc, start, end)
        crc = crc32c_of([data], crc)
        start = end
        if start >= loc.length and crc != loc.crc32c:
            raise _crc_failed(store, m, loc, crc)
        yield data


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    wide = torch.complex128 if a.is_complex() else torch.float64
    return float((a.to(wide) - b.to(wide)).abs().max())


def _is_float(dtype: torch.dtype) -> bool:
    """Whether a difference has a size (packed dtypes compare by bytes only)."""
    return (dtype.is_floating_point or dtype.is_complex) and not is_packed(dtype)


def _as(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else \
        torch.empty(0, dtype=dtype)


def _compare_chunked(store, ma, ta, mb, tb, dtype, progress) -> tuple[bool, float | None]:
    """Same chunking: compare chunk by chunk, block by block. (changed, max abs diff)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    block = max(itemsize, BLOCK_BYTES // itemsize * itemsize)
    by_key = {(tuple(c["offsets"]), tuple(c["sizes"])): c["location"] for c in tb["chunks"]}
    changed, worst = False, 0.0
    for c in ta["chunks"]:
        la, lb = c["location"], by_key[(tuple(c["offsets"]), tuple(c["sizes"]))]
        for xa, xb in zip(_blocks(store, ma, la, block), _blocks(store, mb, lb, block)):
            if xa != xb:
                changed = True
                if _is_float(dtype):
                    d = _max_abs(_as(xa, dtype), _as(xb, dtype))
                    worst = d if math.isnan(d) or math.isnan(worst) else max(worst, d)
            progress(len(xa) + len(xb))
    return changed, (worst if changed and _is_float(dtype) else None)


def _assemble(store: CheckpointStore, m: Manifest, t: dict[str, Any], dtype: torch.dtype,
              progress) -> torch.Tensor:
    full = torch.empty(t["shape"], dtype=dtype)
    for c in t["chunks"]:
        loc = c["location"]
        data = b"".join(_blocks(store, m, loc, max(loc.length, 1)))
        piece = _as(data, dtype).view(c["sizes"])
        full[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))] = piece
        progress(len(data))
    return full


def diff(store: CheckpointStore, a: Selected, b: Selected, *,
         max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
         progress: Progress | None = None) -> dict[str, Any]:
    """Compare checkpoints ``a`` and ``b`` key by key.

    Returns ``{"a", "b", "tensors": [...], "objects": [...], "counts", "identical",
    "not_compared"}``; each tensor row has ``key`` and ``status`` (identical, changed,
    added, removed, shape_changed, dtype_changed, not_compared) and, for a changed
    floating tensor, ``max_abs_diff``. Raises ``CorruptCheckpointError`` when data fails its
    checksum.
    """
    ma, mb = a.manifest, b.manifest
    rows: list[dict[str, Any]] = []
    common = [k for k in ma.tensors if k in mb.tensors]
    total = sum(_numel_bytes(ma.tensors[k], k) + _numel_bytes(mb.tensors[k], k)
                for k in common if ma.tensors[k]["dtype"] == mb.tensors[k]["dtype"]
                and ma.tensors[k]["shape"] == mb.tensors[k]["shape"])
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    if progress:
        progress(0, total)
    for key in sorted(set(ma.tensors) | set(mb.tensors)):
        ta, tb = ma.tensors.get(key), mb.tensors.get(key)
        if ta is None or tb is None:
            t = tb if ta is None else ta
            rows.append({"key": key, "status": "added" if ta is None else "removed",
                         "shape": t["shape"], "dtype": t["dtype"]})
            continue
        row: dict[str, Any] = {"key": key, "shape": ta["shape"], "dtype": ta["dtype"]}
        rows.append(row)
        if ta["dtype"] != tb["dtype"] or ta["shape"] != tb["shape"]:
            row.update(status="dtype_changed" if ta["shape"] == tb["shape"] else
                       "shape_changed", b_shape=tb["shape"], b_dtype=tb["dtype"])
            continue
        dtype = dtype_from_name(ta["dtype"], key)
        if _chunk_keys(ta) == _chunk_keys(tb):
            changed, worst = _compare_chunked(store, ma, ta, mb, tb, dtype, advance)
        elif ma.span is not None or mb.span is not None:
            # One node's share may hold a tensor in part: assembled whole, the rest would be
            # whatever the memory held.
            row.update(status="not_compared", reason=(
                "the two checkpoints chunk it differently and a node's share (a node-local "
                "checkpoint) holds it only in part"))
            advance(2 * _numel_bytes(ta, key))
            continue
        else:
            nbytes = _numel_bytes(ta, key)
            if nbytes > max_tensor_bytes:
                row.update(status="not_compared", reason=(
                    f"the two checkpoints chunk it differently and it is {nbytes} bytes, "
                    f"over the {max_tensor_bytes}-byte limit for assembling it whole"))
                advance(2 * nbytes)
                continue
            xa = _assemble(store, ma, ta, dtype, advance)
            xb = _assemble(store, mb, tb, dtype, advance)
            # Bytes, not values: a NaN equals itself, -0.0 differs from 0.0 (as in the data).
            changed = not torch.equal(xa.view(-1).view(torch.uint8),
                                      xb.view(-1).view(torch.uint8)) if xa.numel() else False
            worst = _max_abs(xa, xb) if changed and _is_float(dtype) else None
            del xa, xb
        row["status"] = "changed" if changed else "identical"
        if worst is not None:
            row["max_abs_diff"] = worst
    objects: list[dict[str, Any]] = []
    for key in sorted(set(ma.objects) | set(mb.objects)):
        if key not in ma.objects or key not in mb.objects:
            objects.append({"key": key, "status": "added" if key not in ma.objects
                            else "removed"})
            continue
        ba, bb = _object_bytes(store, ma, key), _object_bytes(store, mb, key)
        va, vb = _decode(store, ma, key, ba), _decode(store, mb, key, bb)
        same = ba == bb
        row = {"key": key, "status": "identical" if same else "changed"}
        if not same and all(len(repr(v)) <= 200 for v in (va, vb)):
            row.update(a=repr(va), b=repr(vb))
        objects.append(row)
    counts: dict[str, int] = {}
    for r in rows + objects:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    not_compared = [r["key"] for r in rows if r["status"] == "not_compared"]
    identical = all(r["status"] == "identical" for r in rows + objects)
    return {"a": {"step": ma.step, "id": ma.save_id}, "b": {"step": mb.step, "id": mb.save_id},
            "tensors": rows, "objects": objects, "counts": counts,
            "identical": identical, "not_compared": not_compared}


# -- history -------------------------------------------------------------------------------
def history(store: CheckpointStore, *, mtbf_prior_seconds: float = 86400.0,
            prior_weight: float = 1.0) -> dict[str, Any]:
    """The job's failure history and the MTBF the ``auto`` cadence derives from it (with the
    given prior), and the lease record. Read only."""

    h = load_history(store.storage)
    out: dict[str, Any] = {"file": store.storage.describe(HISTORY_NAME), "found": h is not None}
    if h is not None:
        observed = h.uptime_seconds / h.num_failures if h.num_failures else None
        out.update(
            num_failures=h.num_failures,
            failures=[{"unix": t, "time": _iso(t)} for t in h.failure_times],
            uptime_seconds=h.uptime_seconds,
            mtbf_prior_seconds=mtbf_prior_seconds, prior_weight=prior_weight,
            mtbf_seconds=h.mtbf(mtbf_prior_seconds, prior_weight),
            mtbf_observed_seconds=observed)
    lease = read_lease(store.storage)
    if lease is not None:
        keep = ("holder", "job", "host", "pid", "generation", "released", "acquired_unix",
                "heartbeat_unix", "damaged")
        lease = {k: lease[k] for k in keep if k in lease}
        for k in ("acquired_unix", "heartbeat_unix"):
            if k in lease:
                lease[k.replace("_unix", "")] = _iso(lease[k])
    out["lease"] = lease
    return out
