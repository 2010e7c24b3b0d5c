"""``python -m trainer`` with slow checkpoint storage from one step on: a window to kill a save.

Run it like the trainer (alone or under torchrun) with the same arguments. Every data file
of a checkpoint at step ``$E2E_SLOW_FROM_STEP`` or later is written only after
``$E2E_WRITE_DELAY_SECONDS`` (default 5), so a test that sees ``save_staged`` for such a step
in the event log can kill the job while that save is certainly in flight: its marker
is written, the data is not complete, the manifest is not. ("From" rather than "at": when
the save due at a step is skipped because the previous one is still persisting, the next
one is slow instead.) Nothing else changes; the resumed run is plain ``python -m trainer``.
"""

from __future__ import annotations

import os
import sys
import time

from ckpt.format import parse_step_dirname
from ckpt.format import data_file_id
from ckpt.storage import Storage

_FROM_STEP = int(os.environ["E2E_SLOW_FROM_STEP"])
_DELAY = float(os.environ.get("E2E_WRITE_DELAY_SECONDS", "5"))
_write_buffers = Storage.write_buffers


def _slow_write_buffers(self, rel, buffers, **kwargs):
    step = parse_step_dirname(rel.split("/", 1)[0])
    if step is not None and step >= _FROM_STEP and data_file_id(rel.rsplit("/", 1)[-1]):
        time.sleep(_DELAY)
    return _write_buffers(self, rel, buffers, **kwargs)


Storage.write_buffers = _slow_write_buffers

if __name__ == "__main__":
    from trainer.__main__ import main

    sys.exit(main())
