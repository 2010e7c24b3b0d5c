"""Local disk (plain paths and ``file://``): durable writes, exclusive creates, no links.

A checkpoint root is untrusted input, so nothing is read, written, listed or deleted
through a symbolic link inside it: a folder on the way to a file that is a link (below the
root, or below the root a root lies inside: ``Storage.child``) is refused with
:class:`~ckpt.errors.CorruptCheckpointError` naming the link, and a file that is itself a
link is never opened (``O_NOFOLLOW``). Writes never go through a planted link or hard link
either: a file is written to a fresh temporary name in the same folder
(``O_CREAT|O_EXCL|O_NOFOLLOW``), fsync'd and renamed over the target (the rename replaces a
link, it does not follow it); a link in the way of a delete is removed itself, never what
it points to; folders are created one at a time, each checked to be a folder.

Size: one backend: every operation of the storage interface on local disk under the one
no-link rule, the lease's compare-and-swap included, since each must hold it alike.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time
import uuid
from typing import Any, Callable, Sequence

from ckpt.errors import CorruptCheckpointError
from ckpt.storage._base import FsspecBackend, too_large_error

__all__ = ["LocalBackend", "replace_file", "write_new_file", "fsync_dir"]

log = logging.getLogger("ckpt.storage")
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LocalBackend(FsspecBackend):
    """Files under a local folder. Everything that reads, writes, lists or deletes is done
    here with ``os`` calls, never through a link (see the module docstring).

    ``anchor``: the folder (the root as the user gave it, or the root it lies inside:
    :meth:`ckpt.storage.Storage.child`) below which no folder may be a link; the anchor
    itself may be one (a root placed on another disk by its owner)."""

    shared_across_processes = True

    swap_lock_timeout_seconds = 10.0
    """How long :meth:`replace_if_unchanged` waits for the same swapper's lock before it
    breaks it. Breaking the lock of a swapper that is still alive is safe (its swap then
    fails and it starts over), so this only bounds how long a dead swapper stalls the others;
    it is far above a swap's time (a write, two renames, a sync)."""

    stale_stage_seconds = 60.0
    """How old a staged swap folder (``<rel>.swap-<token>``, step 1 of
    :meth:`replace_if_unchanged`) must be before a swap removes it as a dead swapper's
    leftover. Removing a live swapper's is safe too (it starts over), so this only keeps a
    swapper waiting for the lock from being sent back needlessly."""

    def __init__(self, url: str, fs: Any, root: str, retry: Any, anchor: str | None = None):
        super().__init__(url, fs, root, retry)
        self.anchor = (anchor or self.root).rstrip(os.sep) or os.sep
        self._swept: set[str] = set()  # records whose stale staged swaps this one removed

    def local_path(self, rel: str) -> str:
        return self.path(rel)

    def _below_anchor(self, path: str) -> list[str]:
        """The names from the anchor down to ``path`` (empty for the anchor itself)."""
        relative = os.path.relpath(path, self.anchor)
        if relative == os.curdir:
            return []
        parts = relative.split(os.sep)
        assert os.pardir not in parts, (path, self.anchor)  # names are plain: never above
        return parts

    def _check_inside_root(self, rel: str, *, itself: bool = False) -> None:
        """Refuse ``rel`` when a folder on its way from the anchor (and, with ``itself``,
        ``rel`` itself) is a symbolic link: ``CorruptCheckpointError`` naming the link.
        Checked with ``lstat`` one name at a time; a name that does not exist ends the
        check (nothing below it can be a link yet)."""
        path = self.path(rel)
        current = self.anchor
        for name in self._below_anchor(path if itself else os.path.dirname(path)):
            current = os.path.join(current, name)
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                return
            if stat.S_ISLNK(mode):
                raise self._link_error(rel, current)

    def _link_error(self, rel: str, link: str) -> CorruptCheckpointError:
        where = self.describe(rel)
        target = os.path.realpath(link)
        anchor = os.path.realpath(self.anchor)
        inside = target == anchor or target.startswith(anchor.rstrip(os.sep) + os.sep)
        lies = "behind a link" if inside else f"outside the checkpoint root {self.url}"
        return CorruptCheckpointError(
            f"{where} lies {lies}: {link} is a symbolic link (to {target}); ckpt never "
            f"reads or writes through links in a checkpoint root. Replace the link with the "
            f"folder itself or delete it.", path=where)

    def open_fd(self, rel: str) -> int:
        """A read-only file descriptor of ``rel``, never through a link
        (``CorruptCheckpointError`` naming it)."""
        self._check_inside_root(rel)
        try:
            return os.open(self.path(rel), os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            where = self.describe(rel)
            raise CorruptCheckpointError(
                f"{where} is a symbolic link; ckpt never reads through links in a checkpoint "
                f"root (it could lead anywhere). Replace it with the file itself or delete it.",
                path=where) from None

    def size(self, rel: str) -> int:
        fd = self.open_fd(rel)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read(self, rel: str, start: int | None, end: int | None) -> bytes:
        with os.fdopen(self.open_fd(rel), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            lo = 0 if start is None else (max(0, size + start) if start < 0 else start)
            hi = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
            if hi <= lo:
                return b""
            f.seek(lo)
            return f.read(hi - lo)

    def read_at_most(self, rel: str, max_bytes: int) -> bytes:
        """The file's size is known once it is open: a larger one is refused unread."""
        with os.fdopen(self.open_fd(rel), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise too_large_error(self.describe(rel), max_bytes, size)
            return f.read(max_bytes + 1)

    def listdir(self, rel: str) -> list[tuple[str, str, int]]:
        """As fsspec lists it (a link inside is listed as a file, never followed), after
        refusing a folder that is, or lies behind, a link."""
        self._check_inside_root(rel, itself=True)
        return super().listdir(rel)

    def makedirs(self, rel: str) -> None:
        """The anchor as fsspec makes it, then each folder below it one at a time, each
        checked to be a folder and not a link (a planted one is refused, never followed)."""
        os.makedirs(self.anchor, exist_ok=True)
        current = self.anchor
        for name in self._below_anchor(self.path(rel)):
            current = os.path.join(current, name)
            try:
                os.mkdir(current)
            except FileExistsError:
                pass
            mode = os.lstat(current).st_mode
            if stat.S_ISLNK(mode):
                raise self._link_error(rel, current)
            if not stat.S_ISDIR(mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{self.describe(rel)}: {current} is "
                                         f"a file, not a folder")

    def delete(self, rel: str, recursive: bool) -> None:
        """A link is removed itself, never what it leads to; a folder only ``recursive``
        (``shutil.rmtree``, which does not follow the links inside either)."""
        self._check_inside_root(rel)
        path = self.path(rel)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        try:
            if not stat.S_ISDIR(mode):
                os.unlink(path)
            elif recursive:
                shutil.rmtree(path)
            else:
                raise IsADirectoryError(errno.EISDIR, f"{self.describe(rel)} is a folder")
        except FileNotFoundError:
            pass

    def rmdir(self, rel: str) -> None:
        self._check_inside_root(rel)
        os.rmdir(self.path(rel))

    def write(self, rel: str, views: Sequence[memoryview], *, durable: bool, part_bytes: int,
              max_concurrency: int) -> None:
        self.retry.call(f"write {self.describe(rel)}",
                        lambda: self._write_and_rename(rel, views, durable))

    def _write_and_rename(self, rel: str, views: Sequence[memoryview], durable: bool) -> None:
        """Write a fresh temporary file next to ``rel`` and rename it over ``rel``."""
        self._check_inside_root(rel)

        def write(f) -> None:
            for view in views:
                f.write(view)
        replace_file(self.path(rel), write, durable=durable)

    def create_fd(self, rel: str) -> int:
        """A descriptor to write new file ``rel``: created exclusively, never through a
        link, inside the root (``FileExistsError`` if anything is there)."""
        self._check_inside_root(rel)
        return _create_file(self.path(rel))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Write a fsync'd temporary file and hard-link it into place (``link`` fails if the
        target exists, unlike ``rename``); False if ``rel`` already exists."""
        self._check_inside_root(rel)
        p = self.path(rel)
        tmp = _tmp_name(p)
        write_new_file(tmp, data)
        try:
            os.link(tmp, p)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            # A filesystem without hard links: O_EXCL still makes the create exclusive.
            try:
                write_new_file(p, data)
            except FileExistsError:
                return False
        finally:
            os.unlink(tmp)
        fsync_dir(os.path.dirname(p))
        return True

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        """A compare-and-swap whose write lands only while the swapper still holds its lock,
        so a lock broken as stale cannot let a late swapper overwrite a newer record.

        The lock is the folder ``<rel>.swap-lock``, and it is never empty while held: it
        holds the swapper's new record under a name of its own (a random token). A swap:

        1. stage: a fresh folder ``<rel>.swap-<token>`` with the new record ``<token>`` in
           it, synced;
        2. lock: rename the staged folder to ``<rel>.swap-lock``. A rename onto a folder that
           is not empty fails, so only one swapper holds the lock (an empty one, left by a
           swapper that finished, is replaced);
        3. compare: read ``rel``; if it is not ``expected``, unlock and return False;
        4. swap: rename ``<rel>.swap-lock/<token>`` over ``rel`` (the file never disappears,
           so an exclusive create cannot slip in); then unlock (remove the empty folder).

        A lock whose token has not changed for :attr:`swap_lock_timeout_seconds` is broken
        by deleting the record inside it, then the folder. Once its record is deleted, the
        owner's rename in step 4 finds no file and fails: whether owner or breaker came
        first is decided by the file system within one rename or one unlink of that name,
        never by the owner's age. The interleavings, for a holder A swapping over record X
        and a job B taking over (B breaks A's lock, then swaps X for its own record Y):

        * A renames before B deletes its record: A's swap landed first (its record is X'),
          B compares X' with X and fails; B reads again and takes X' over when it is stale,
          and A's next swap (over X') fails: A learns it lost.
        * B deletes A's record first: A's rename fails (its record is gone), A starts over
          from step 1 and compares again: it finds Y (B's swap landed) and returns False,
          or still X (B has not swapped yet) and swaps, and then B's compare fails as above.
        * A pauses anywhere (before, inside or after the compare) for any time: the two
          cases above, since only step 4 changes ``rel``.
        * A breaker itself delayed after deciding to break deletes only the token it saw:
          a swapper that finished meanwhile has moved it away already, and a new lock holds
          another token (the breaker's folder removal then fails on a folder not empty).

        So a late swapper never replaces a record it did not compare. A rename that landed
        but was reported refused (an NFS reply lost) starts over too, finds its own ``data``
        and returns True.

        A swapper that dies between steps 1 and 2 (killed while it waits for the lock, say)
        leaves its staged folder. The first swap of ``rel`` through this backend removes
        those older than :attr:`stale_stage_seconds` (its record, then the folder), as a job
        taking or renewing its lease, or ``ckpt gc`` taking it, does. A swapper still alive
        behind one that was removed finds it gone at step 2, or takes the lock with no
        record in it and finds its step 4 refused: it starts over, never writing.
        """
        self._check_inside_root(rel)
        p = self.path(rel)
        while True:
            swapped = self._swap_once(p, data, expected)
            if swapped is not None:
                break
        if p not in self._swept:
            self._swept.add(p)
            _remove_stale_stages(p, self.stale_stage_seconds)
        return swapped

    def _swap_once(self, p: str, data: bytes, expected: bytes) -> bool | None:
        """Steps 1-4 of :meth:`replace_if_unchanged` once; None when the lock was broken
        before the swap landed, or the staged folder was removed as stale (start over)."""
        lock = f"{p}.swap-lock"
        token = uuid.uuid4().hex
        stage = f"{p}.swap-{token}"
        os.mkdir(stage)
        try:
            write_new_file(os.path.join(stage, token), data)
            if not self._take_lock(stage, lock):
                return None
        except FileNotFoundError:
            return None  # the staged folder was removed as stale meanwhile
        except BaseException:
            _remove_folder(stage, [token])
            raise
        mine = os.path.join(lock, token)
        try:
            current = _read_record(p, max(len(expected), len(data)))
            if current != expected:
                return current == data
            try:
                os.replace(mine, p)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ESTALE):
                    return None  # broken: our record is gone, nothing was written
                raise
            fsync_dir(os.path.dirname(p))
            return True
        finally:
            _remove_folder(lock, [token])

    def _take_lock(self, stage: str, lock: str) -> bool:
        """Rename ``stage`` (not empty) to ``lock``; wait while another swapper holds it,
        and break a lock whose holder has not changed for the timeout. False when
        ``stage`` is gone (removed as stale while this swapper waited)."""
        seen: list[str] | None = None
        deadline = 0.0
        while True:
            try:
                os.rename(stage, lock)
                return True
            except OSError as exc:
                if exc.errno == errno.ENOENT and not os.path.lexists(stage):
                    return False
                if exc.errno == errno.ENOTDIR:
                    raise CorruptCheckpointError(
                        f"{lock} is in the way of the lease's compare-and-swap (it is not a "
                        f"folder); delete it", path=lock) from None
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            holder = _entries(lock)
            if holder is None:
                continue  # released meanwhile
            now = time.monotonic()
            if holder != seen:
                seen, deadline = holder, now + self.swap_lock_timeout_seconds
            elif now > deadline:
                log.warning("breaking the lock %s of a swap unfinished after %.0f s (its "
                            "swapper, if alive, will find its swap refused and start over)",
                            lock, self.swap_lock_timeout_seconds)
                _remove_folder(lock, holder)
                if _entries(lock) == holder:
                    raise CorruptCheckpointError(
                        f"{lock} cannot be broken (it holds {holder}, which is not a swap's "
                        f"record); delete it", path=lock)
                seen = None
                continue
            time.sleep(0.005)


def replace_file(path: str, write: Callable[[Any], None], *, durable: bool = True) -> None:
    """Write ``path`` atomically: ``write(file)`` fills a fresh temporary file beside it
    (created exclusively, never through a link), which is synced and renamed over ``path``
    (a link planted at ``path`` is replaced, not followed); then the folder is synced."""
    tmp = _tmp_name(path)
    fd = _create_file(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(path))  # the new name must survive a crash too


def _create_file(path: str) -> int:
    """A descriptor to write a new file at ``path``: created exclusively, never through a
    link (``FileExistsError`` if anything, a link included, is there). Its permissions are
    0o666 less the umask, as for any file a program creates."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                   0o666)


def write_new_file(path: str, data: bytes) -> None:
    """``data`` in a new file at ``path`` (see :func:`_create_file`), fsync'd."""
    with os.fdopen(_create_file(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_record(path: str, max_bytes: int) -> bytes | None:
    """The bytes of ``path``, or None when it is absent or a link (never read through); of
    a file larger than ``max_bytes``, only its first ``max_bytes + 1`` (enough to tell it
    from any record of at most ``max_bytes``)."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes + 1)


def _entries(folder: str) -> list[str] | None:
    """The names in ``folder``, sorted; None when it is gone."""
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _remove_stale_stages(p: str, older_than_seconds: float) -> None:
    """Remove the staged swap folders of record ``p`` (``<p>.swap-<token>`` holding at most
    its record ``<token>``) unchanged for ``older_than_seconds``: dead swappers' leftovers
    (see :meth:`LocalBackend.replace_if_unchanged`). Anything else there is left alone."""
    folder, prefix = os.path.dirname(p), os.path.basename(p) + ".swap-"
    try:
        names = os.listdir(folder)
    except OSError:
        return
    now = time.time()
    for name in names:
        token = name[len(prefix):]
        if not name.startswith(prefix) or len(token) != 32 \
                or token.strip("0123456789abcdef"):
            continue  # the lock, or nobody's
        stage = os.path.join(folder, name)
        try:
            st = os.lstat(stage)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or now - st.st_mtime < older_than_seconds:
            continue
        held = _entries(stage)
        if held is None or not set(held) <= {token}:
            continue
        log.info("removing %s, a swap staged %.0f s ago by a swapper that never took the "
                 "lock", stage, now - st.st_mtime)
        _remove_folder(stage, held)


def _remove_folder(folder: str, names: Sequence[str]) -> None:
    """Delete ``names`` in ``folder``, then the folder if that left it empty; whatever is
    gone already, or was put there by someone else meanwhile, is left as it is."""
    for name in names:
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
        except OSError as exc:  # a folder planted in a lock: reported by the caller
            log.debug("could not remove %s/%s: %s", folder, name, exc)
    try:
        os.rmdir(folder)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            raise


def _tmp_name(p: str) -> str:
    """A fresh name next to ``p`` (``commit.py`` recognises and removes leftovers)."""
    return f"{p}.tmp-{uuid.uuid4().hex[:12]}"


def fsync_dir(path: str) -> None:
    """Sync a folder's entries (best effort: a filesystem that cannot is left as it is)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
