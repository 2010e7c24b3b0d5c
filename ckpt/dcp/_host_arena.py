"""One block of host memory that holds many tensors: the storage of the staging buffers.

Layout: slots in the order asked for, each at a multiple of ``ALIGN_BYTES`` (512) from a
page-aligned start. So a view of any dtype in any slot is aligned for its dtype (views at
misaligned offsets have crashed copies: PLATFORM.md), slots never overlap, and the block is
the sum of the aligned slot sizes: nothing is rounded up to a power of two.

Pinning (for asynchronous device-to-host copies): the block is ordinary memory from torch's
CPU allocator, page-locked in place with ``cudaHostRegister`` for exactly its size, and
unregistered by ``release()``. Not torch's pinned caching allocator (``pin_memory=True``):
it rounds each allocation up to the next power of two (a 5 GiB block would lock 8 GiB) and
keeps freed blocks for itself until its cache is emptied. Should registering fail, the block
comes from that allocator after all (copies stay asynchronous) and ``release()`` empties its
cache. Without CUDA nothing is pinned and everything else is the same code.

Device: an arena is pinned for one CUDA device (``pin_on``: the device of the tensors copied
into it), and every CUDA call it makes (register, unregister, the fallback allocation,
emptying the cache) runs under ``torch.cuda.device(pin_on)``, on whichever thread calls:
the runtime binding has no device guard of its own, so on a thread that never selected a
device (a fresh worker thread starts on device 0) it would create a CUDA context on GPU 0,
in every rank's process. The registration is portable, so the page lock holds for every
context of the process all the same.

Memory is returned when the last view of the block is gone: ``release()`` drops the arena's
own references (and the page lock, first), views handed out earlier keep their bytes alive.

Shared (``shared=True``): the block is a file in ``/dev/shm`` (the temporary directory where
there is none), mapped into this process, so that another process (the manager's writer
process, :mod:`ckpt.job._writer_process`) maps the same pages by its name (``path``) and
reads what was staged without a copy. Its pages are reserved when it is made
(``posix_fallocate``: a full ``/dev/shm`` is an error here, never a SIGBUS at a later
touch); ``release()`` removes the name, and the pages go with the last mapping. Its name
carries its owner's pid (``ckpt-staging-<pid>-<random>``) and its owner holds a shared
``flock`` on it while the arena lives, so that a block a killed process left behind (a
SIGKILL skips ``release()``) is told apart from a live one and removed by
:func:`remove_stale_shared_blocks`.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat
import tempfile
import warnings
import weakref
from typing import Sequence

import torch

__all__ = ["HostArena", "ALIGN_BYTES", "aligned_bytes", "release_host_cache", "map_shared",
           "remove_stale_shared_blocks"]

log = logging.getLogger(__name__)

ALIGN_BYTES = 512  # slot alignment: above any dtype's (16 for complex128), sector-aligned
_PAGE_BYTES = mmap.PAGESIZE
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def aligned_bytes(nbytes: int, alignment: int = ALIGN_BYTES) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-int(nbytes) // alignment) * alignment


def release_host_cache(device: torch.device) -> None:
    """Give the pinned blocks that torch's host caching allocator keeps but nobody uses
    back to the system, where this torch offers it (a no-op elsewhere, e.g. without CUDA).
    The frees run under ``device`` (a CUDA device this process uses), not the calling
    thread's current one."""
    if not torch.cuda.is_available():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        try:
            with torch.cuda.device(device):
                empty()
        except RuntimeError as exc:  # no accelerator initialised after all
            log.debug("emptying the host cache failed: %s", exc)


_SHARED_PREFIX = "ckpt-staging-"
_SHARED_NAME = re.compile(rf"{_SHARED_PREFIX}(\d+)-[A-Za-z0-9_]+")


def _shared_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _shared_block(nbytes: int) -> tuple[torch.Tensor, str, int]:
    """``nbytes`` of shared memory (a file in ``/dev/shm``, mapped): the block as bytes, the
    file's path (another process maps it with :func:`map_shared`) and an open descriptor of
    it holding a shared ``flock`` (the block's owner is alive: close it with the block)."""
    directory = _shared_directory()
    fd, path = tempfile.mkstemp(prefix=f"{_SHARED_PREFIX}{os.getpid()}-", dir=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.unlink(path)
            raise OSError(exc.errno, f"could not reserve {nbytes} bytes of shared staging memory "
                          f"in {directory} ({exc.strerror}): make it larger (a container's "
                          f"--shm-size) or save with writer='thread'") from None
        block = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return torch.frombuffer(block, dtype=torch.uint8), path, fd


def _remove(path: str, fd: int) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)  # the flock goes with it


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def remove_stale_shared_blocks() -> list[str]:
    """Remove the shared blocks (``shared=True`` arenas) that processes now gone left behind,
    as a SIGKILL does; returns their paths, each logged.

    A block is removed only when all of these hold: its name is ``ckpt-staging-<pid>-...``
    in the shared directory, it is a regular file of this user, no process ``<pid>`` is
    alive, and no process holds its ``flock`` (every live owner does: a pid of another pid
    namespace sharing ``/dev/shm``, or a pid reused, is never taken for a dead owner on the
    pid alone). Anything else, older names without a pid included, is left alone."""
    directory, removed = _shared_directory(), []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        log.warning("could not list %s for stale shared staging blocks: %s", directory, exc)
        return removed
    for name in sorted(names):
        match = _SHARED_NAME.fullmatch(name)
        if match is None or _process_alive(pid := int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, a link, or not ours to read
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives (in another pid namespace)
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue  # replaced since it was opened
            os.unlink(path)
        except OSError:
            continue
        finally:
            os.close(fd)
        log.warning("removed the shared staging block %s (%d MiB) of process %d, which is "
                    "gone (killed before it could remove it)", path, st.st_size >> 20, pid)
        removed.append(path)
    return removed


def map_shared(path: str, nbytes: int) -> torch.Tensor:
    """The shared block at ``path`` (made by a ``HostArena(shared=True)``), mapped read-only
    into this process: its first ``nbytes`` as a uint8 tensor. Raises ``FileNotFoundError``
    once its owner released it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared staging block {path} holds {size} bytes, not the {nbytes} "
                             f"described: it was replaced; hand the save off again")
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        block = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only on purpose: the writer never writes here
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(block, dtype=torch.uint8)


def _register(ptr: int, nbytes: int, device: torch.device) -> bool:
    """Page-lock ``nbytes`` at ``ptr`` in place, under ``device``; False (logged) when CUDA
    refuses."""
    try:
        with torch.cuda.device(device):
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE))
    except (RuntimeError, AttributeError, TypeError) as exc:
        log.warning("cudaHostRegister unavailable (%s): staging buffers use torch's pinned "
                    "allocator", exc)
        return False
    if err != 0:
        log.warning("cudaHostRegister of %d bytes failed (cudaError %d): staging buffers use "
                    "torch's pinned allocator", nbytes, err)
        return False
    return True


def _unregister(ptr: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        log.warning("cudaHostUnregister failed (cudaError %d)", err)


class HostArena:
    """``sum(aligned_bytes(n) for n in sizes)`` bytes of host memory in one allocation,
    sliced into one slot per size (``slot(i)``, ``view(i, shape, dtype)``).

    ``pin_on``: page-lock it for this CUDA device (only where CUDA is available; see the
    module docstring); None: not pinned. ``shared``: in shared memory that another process
    maps by ``path`` (module docstring; None when not shared). Not thread-safe: its owner
    (``ckpt.dcp.staging.StagingBuffers``) serialises every use.
    """

    def __init__(self, sizes: Sequence[int], pin_on: torch.device | None = None,
                 shared: bool = False):
        self.offsets: list[int] = []
        self.sizes = [int(n) for n in sizes]
        offset = 0
        for n in self.sizes:
            self.offsets.append(offset)
            offset += aligned_bytes(n)
        self.nbytes = offset
        self.pinned = False
        self.from_pinned_cache = False  # came from torch's pinned caching allocator
        self._unpin: weakref.finalize | None = None
        self._base: torch.Tensor | None = None  # the allocation ``data`` lies in
        self.shared = shared
        self.path: str | None = None  # the shared block's file (``shared``)
        self._unlink: weakref.finalize | None = None
        if pin_on is not None and pin_on.type != "cuda":
            raise ValueError(f"HostArena(pin_on={pin_on}): pinning is for a CUDA device; "
                             f"pass a cuda device, or None for an unpinned arena")
        self.device = pin_on if torch.cuda.is_available() else None  # pinned for it
        self.data = self._allocate()

    def _allocate(self) -> torch.Tensor:
        """The block, page-aligned, touched once per page (so the first save does not pay
        the page faults), and pinned for ``device`` if set."""
        if self.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        locked = aligned_bytes(self.nbytes, _PAGE_BYTES)  # whole pages: no neighbour's
        if self.shared:  # a mapping starts on a page
            base, self.path, fd = _shared_block(locked)
            self._base = base
            # Removed by release(), or at exit when never released (a SIGKILL leaves it,
            # for remove_stale_shared_blocks).
            self._unlink = weakref.finalize(self, _remove, self.path, fd)
        else:
            base = self._base = torch.empty(locked + _PAGE_BYTES, dtype=torch.uint8)
        start = -base.data_ptr() % _PAGE_BYTES
        data = base[start:start + self.nbytes]
        if self.device is not None:
            ptr = base.data_ptr() + start
            if _register(ptr, locked, self.device):
                self.pinned = True
                # Unlocked by release(), or when this arena is collected (on whichever
                # thread collects it: hence the device): before the memory can be freed in
                # any case, since the arena holds ``base`` until then.
                self._unpin = weakref.finalize(self, _unregister, ptr, self.device)
                self._unpin.atexit = False  # the CUDA context may be gone by then
            elif not self.shared:  # shared memory stays unpinned: copies are synchronous
                self._base = None
                with torch.cuda.device(self.device):
                    data = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = self.from_pinned_cache = True
        data[::_PAGE_BYTES].zero_()  # fault in
        return data

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index`` as flat bytes (exactly its size, without the padding)."""
        offset = self.offsets[index]
        return self.data[offset:offset + self.sizes[index]]

    def view(self, index: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Slot ``index`` as a contiguous tensor of ``shape`` and ``dtype`` (its size must
        be that tensor's bytes)."""
        return self.slot(index).view(dtype).view(tuple(shape))

    def release(self) -> None:
        """Drop the arena's hold on its memory: unlock it now and free it with its last
        view (views still referenced elsewhere keep working, as ordinary memory). A block
        from torch's pinned cache goes back to that cache, which is then emptied."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._base = None
        self.data = torch.empty(0, dtype=torch.uint8)
        if self._unlink is not None:  # the name goes now, the pages with the last mapping
            self._unlink()
            self._unlink = None
        self.path = None
        if self.from_pinned_cache:
            release_host_cache(self.device)  # its block went back to torch's cache
        self.offsets, self.sizes, self.nbytes, self.pinned = [], [], 0, False
        self.from_pinned_cache = False
