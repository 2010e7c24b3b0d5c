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
touch); ``release()`` removes the name, and the pages go with the last mapping.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import warnings
import weakref
from typing import Sequence

import torch

__all__ = ["HostArena", "ALIGN_BYTES", "aligned_bytes", "release_host_cache", "map_shared"]

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


def _shared_block(nbytes: int) -> tuple[torch.Tensor, str]:
    """``nbytes`` of shared memory (a file in ``/dev/shm``, mapped): the block as bytes, and
    the file's path (another process maps it with :func:`map_shared`)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="ckpt-staging-", dir=directory)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.unlink(path)
            raise OSError(exc.errno, f"could not reserve {nbytes} bytes of shared staging memory "
                          f"in {directory} ({exc.strerror}): make it larger (a container's "
                          f"--shm-size) or save with writer='thread'") from None
        block = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(block, dtype=torch.uint8), path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
            base, self.path = _shared_block(locked)
            self._base = base
            # Removed by release(), or at exit when never released (a SIGKILL leaves it).
            self._unlink = weakref.finalize(self, _remove, self.path)
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
