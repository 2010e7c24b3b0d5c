"""Where an export writes: checks of the output path, and the attachment files.

The checks run before anything is read, so a wrong ``--out`` fails in a second, not after
a long read. Every file is written atomically, never through a planted link (the local
backend's own way: :func:`ckpt.storage._local.replace_file`).
"""

from __future__ import annotations

import os
from typing import Iterable

from ckpt.storage import replace_file

__all__ = ["check_out_file", "check_out_dir", "check_no_clash", "write_attachment_files"]


def _check_parent(parent: str) -> None:
    if not os.path.exists(parent):
        raise ValueError(f"output folder {parent} does not exist; create it or choose "
                         f"another --out")
    if not os.path.isdir(parent):
        raise ValueError(f"output folder {parent} is a file, not a folder; choose another "
                         f"--out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output folder {parent} is not writable; fix its permissions or "
                         f"choose another --out")


def check_out_file(out: str) -> None:
    """Refuse an output file that cannot be written, before anything is read."""
    if os.path.isdir(out):
        raise ValueError(f"--out {out} is a folder; name a file in it, such as "
                         f"{os.path.join(out, 'model.safetensors')}")
    _check_parent(os.path.dirname(os.path.abspath(out)))


def check_out_dir(out: str, *, force: bool = False) -> None:
    """Refuse an output folder that cannot be (re)placed, before anything is read."""
    if os.path.islink(out):
        raise ValueError(f"--out {out} is a symbolic link; name a real folder")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; --format hf writes a folder, name a new one")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise FileExistsError(f"--out {out} is a folder that is not empty; pass --force to "
                              f"replace it, or name a new folder")
    _check_parent(os.path.dirname(os.path.abspath(out)))


def check_no_clash(names: Iterable[str], out_dir: str, force: bool) -> None:
    """Refuse to overwrite a file of ``out_dir`` named in ``names``, unless ``force``."""
    clash = [n for n in names if os.path.lexists(os.path.join(out_dir, n))]
    if clash and not force:
        raise FileExistsError(f"--attachments {out_dir}: {', '.join(clash)} already exist(s); "
                              f"pass --force to overwrite, or choose another folder")


def write_attachment_files(datas: dict[str, bytes], out_dir: str, force: bool) -> None:
    """Each ``name: data`` as a file of ``out_dir`` (created if missing), atomically;
    refused before any is written if one exists, unless ``force``."""
    os.makedirs(out_dir, exist_ok=True)
    check_no_clash(datas, out_dir, force)
    for name, data in datas.items():
        replace_file(os.path.join(out_dir, name), lambda f, d=data: f.write(d))
