"""Fencing: which manifests count, once the write lease has changed hands.

Every acquisition of a root's lease takes a new *generation* ``G`` (:mod:`ckpt.root.lease`), and
every manifest records the generation and the holder it was written under. The files here,
under ``_fence/`` at the root, each created exclusively and never changed::

    gen_G.open      {"generation", "holder"}          generation G was taken by ``holder``
    gen_G.closing   {"generation", "holder"}          G is being closed: from now on its
                                                      manifests count only if listed below
    gen_G.json      {"generation", "holder",          the close record: the save ids of G's
                     "committed": [save ids], ...}    manifests that existed when G closed

A new holder closes every earlier generation that did not close itself (marker first, then
a listing of the manifests present, then the record); a holder that releases cleanly closes
its own generation with what it committed. The acceptance rule (``is_fenced``) and why it
holds are in docs/format.md, "Fencing". Generations are numbered per root: a fence file
speaks only for manifests of the holder it names, so a checkpoint copied in from another
root is never judged by this root's files.
"""

from __future__ import annotations

import re
import time
from typing import Any, Iterable

from ckpt.errors import CorruptCheckpointError
from ckpt.format import Manifest, jsonio
from ckpt.storage import Storage

__all__ = ["Fence", "FENCE_DIR"]

FENCE_DIR = "_fence"
_NAME_RE = re.compile(r"^gen_(\d+)\.(json|closing|open)$")


class Fence:
    """The fence files of one root (read by anyone, written by the lease holder)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._cache: dict[tuple[int, str], dict[str, Any]] = {}

    def _rel(self, generation: int, what: str) -> str:
        return f"{FENCE_DIR}/gen_{generation:09d}.{what}"

    def doc(self, generation: int, what: str) -> dict[str, Any] | None:
        """``gen_G.<what>`` parsed, or None when absent (a present one is cached: fence
        files never change once written)."""
        key = (generation, what)
        if key in self._cache:
            return self._cache[key]
        rel = self._rel(generation, what)
        try:
            raw = self.storage.read_bytes(rel, max_bytes=16 << 20)
        except FileNotFoundError:
            return None
        where = self.storage.describe(rel)
        doc = jsonio.loads(raw, where, max_bytes=16 << 20)
        ids = doc.get("committed", []) if isinstance(doc, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids) \
                or not isinstance(doc.get("holder"), (str, type(None))):
            raise CorruptCheckpointError(
                f"{where} is damaged (expected 'holder' and a list of save ids under "
                f"'committed'). Restore it from a backup or delete it (then manifests of "
                f"generation {generation} are all accepted).", path=where)
        self._cache[key] = doc
        return doc

    def generations(self) -> tuple[set[int], set[int]]:
        """``(opened, closed)``: generations ever taken (or being closed), and those with a
        close record."""
        opened, closed = set(), set()
        for name, kind, _ in self.storage.listdir(FENCE_DIR):
            m = _NAME_RE.match(name)
            if m and kind == "file":
                (closed if m.group(2) == "json" else opened).add(int(m.group(1)))
        return opened, closed

    @staticmethod
    def _speaks_for(doc: dict[str, Any], holder: Any) -> bool:
        return doc.get("holder") is None or doc.get("holder") == holder

    def is_fenced(self, manifest: Manifest) -> bool:
        """True when ``manifest`` may have been created after its writer's generation ended.

        Checked after the manifest was read. If its generation's closing marker is absent
        now, it was absent when the manifest was created, so the manifest predates the
        closer's listing and will be in its record: accepted. Once the marker exists, only
        the record decides (and until it exists, the manifest is not accepted).
        """
        generation = manifest.writer.get("lease_generation")
        holder = manifest.writer.get("owner")
        if not isinstance(generation, int) or isinstance(generation, bool):
            return False  # written without a lease
        closing = self.doc(generation, "closing")
        if closing is None or not self._speaks_for(closing, holder):
            return False
        record = self.doc(generation, "json")
        if record is not None and not self._speaks_for(record, holder):
            return False
        return record is None or manifest.save_id not in record.get("committed", [])

    # -- write side: the lease holder only ------------------------------------------------
    def mark(self, generation: int, what: str, holder: str | None) -> None:
        """Create ``gen_G.open`` (generation taken by ``holder``) or ``gen_G.closing``."""
        self.storage.makedirs(FENCE_DIR)
        try:
            self.storage.create_exclusive(self._rel(generation, what), jsonio.dumps(
                {"generation": generation, "holder": holder, f"{what}_unix": time.time()}))
        except FileExistsError:
            pass

    def close(self, generation: int, manifests: Iterable[Manifest], *,
              closed_by: str | None) -> None:
        """Close a generation whose holder did not: mark it closing, then record the save
        ids of its manifests present now (``manifests`` is iterated after the marker)."""
        if self.doc(generation, "json") is not None:
            return
        holder = (self.doc(generation, "open") or {}).get("holder")
        self.mark(generation, "closing", holder)
        committed = [m.save_id for m in manifests
                     if m.writer.get("lease_generation") == generation
                     and (holder is None or m.writer.get("owner") == holder)]
        self.write_close(generation, committed, holder, closed_by=closed_by)

    def write_close(self, generation: int, committed: Iterable[str], holder: str | None, *,
                    closed_by: str | None) -> None:
        """The close record, then the closing marker (a no-op when ``close`` made it first).

        A holder closing its own generation at release knows every commit it made (none is
        in flight any more), so the record can come first: readers never see the marker
        without the record, and its checkpoints never look in doubt, not even for a moment.
        An existing record stands.
        """
        doc = {"generation": generation, "holder": holder, "committed": sorted(committed),
               "closed_unix": time.time(), "closed_by": closed_by}
        self.storage.makedirs(FENCE_DIR)
        try:
            self.storage.create_exclusive(self._rel(generation, "json"), jsonio.dumps(doc))
        except FileExistsError:
            pass  # closed by someone else first; theirs stands
        self.mark(generation, "closing", holder)
