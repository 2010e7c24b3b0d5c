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

    def __init__(self, url: str, fs: Any, root: str, retry: Any, anchor: str | None = None):
        super().__init__(url, fs, root, retry)
        self.anchor = (anchor or self.root).rstrip(os.sep) or os.sep

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

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes,
                             lock_timeout: float = 10.0) -> bool:
        """Swap under a short-lived lock folder (``mkdir`` is atomic, also on NFS) with
        ``os.replace``, so the file never disappears and an exclusive create cannot slip in
        between. A lock held longer than ``lock_timeout`` belongs to a dead swapper."""
        self._check_inside_root(rel)
        p = self.path(rel)
        lock = f"{p}.swap-lock"
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                os.mkdir(lock)
                break
            except FileExistsError:
                if time.monotonic() > deadline:
                    log.warning("breaking stale lock %s", lock)
                    try:
                        os.rmdir(lock)
                    except FileNotFoundError:
                        pass
                    deadline = time.monotonic() + lock_timeout
                time.sleep(0.005)
        try:
            try:
                # Never through a link: a planted one reads as "someone else changed it".
                fd = os.open(p, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    if f.read() != expected:
                        return False
            except FileNotFoundError:
                return False
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return False
                raise
            replace_file(p, lambda f: f.write(data))
            return True
        finally:
            try:
                os.rmdir(lock)
            except FileNotFoundError:
                pass


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
