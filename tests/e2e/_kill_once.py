"""Run a training program under torchrun with planned faults: a worker SIGKILLs itself.

Usage: ``_kill_once.py -m trainer ARGS...`` or ``_kill_once.py path/to/script.py ARGS...``
(the program runs as ``__main__`` with those arguments, unchanged). ``$KILL_PLAN`` is a list
``STEP:RANK,STEP:RANK,...``; its i-th entry applies to attempt i
(``TORCHELASTIC_RESTART_COUNT == i``) only: that rank, right after
``CheckpointManager.maybe_save`` at that step or later, waits for its in-flight save and,
once a checkpoint is committed, prints the newest committed step and SIGKILLs itself. Every
``load_latest`` prints what it resumed from, so a test can check that each restarted attempt
resumed from exactly the checkpoint committed before the kill::

    kill-once: rank 1 attempt 0 killed at step 12, committed 10
    kill-once: rank 0 attempt 1 resumed 10
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from ckpt.job import CheckpointManager

_ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
_RANK = int(os.environ.get("RANK", "0"))
_PLAN = [tuple(int(x) for x in item.split(":")) for item in os.environ["KILL_PLAN"].split(",")]
_KILL_STEP, _KILL_RANK = _PLAN[_ATTEMPT] if _ATTEMPT < len(_PLAN) else (-1, -1)
_maybe_save = CheckpointManager.maybe_save
_load_latest = CheckpointManager.load_latest


def _say(text: str) -> None:
    print(f"kill-once: rank {_RANK} attempt {_ATTEMPT} {text}", flush=True)


def maybe_save(self, step, *args, **kwargs):
    out = _maybe_save(self, step, *args, **kwargs)
    if _RANK == _KILL_RANK and step >= _KILL_STEP:
        self.wait(raise_errors=False)
        if self.newest_committed_step is not None:
            _say(f"killed at step {step}, committed {self.newest_committed_step}")
            os.kill(os.getpid(), signal.SIGKILL)
    return out


def load_latest(self, *args, **kwargs):
    manifest = _load_latest(self, *args, **kwargs)
    _say(f"resumed {manifest.step if manifest is not None else 0}")
    return manifest


CheckpointManager.maybe_save = maybe_save
CheckpointManager.load_latest = load_latest

if __name__ == "__main__":
    if sys.argv[1] == "-m":
        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
