"""python -m trainer --config FILE [--section.key=value ...] [--debug], python -m trainer plan,
python -m trainer lighthouse [--config FILE] [--fault_tolerance.key=value ...] and
python -m trainer ft-local --groups N [--nproc R] --out DIR --config FILE [...].

Runs under torchrun (one process per rank), as the tasks of an srun step (one per rank;
torch's variables from Slurm's, see trainer.slurm) or alone (one process, no launcher).
"lighthouse" runs torchft's lighthouse with the timing of a config's [fault_tolerance]
section (fault-tolerant replica groups, docs/trainer.md); "ft-local" runs a lighthouse and
every replica group of a job on this machine.
Bad input ends in one line on stderr naming the file or key at fault and the fix, with exit
status 2; --debug adds the traceback to that line and to a training failure's.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from ckpt.errors import OneLineArgumentParser, error_line
from trainer.checkpointing import check_startup
from trainer.config import ConfigError, config_from_argv
from trainer.determinism import apply_determinism
from trainer.distributed import EXIT_CONFIG, EXIT_FAILED, init_distributed, shutdown
from trainer.faults import Preemption
from trainer.ft import LighthouseUnreachable, check_reachable, serve
from trainer.layout_plan import add_layout_plan_arguments, run_layout_plan
from trainer.slurm import export_torch_env
from trainer.train import run

_DEBUG_FLAG = "--debug"


def _fail(prog: str, exc: BaseException, debug: bool, code: int) -> int:
    """Report ``exc`` as one line on stderr (after its traceback with ``debug``)."""
    if debug:
        traceback.print_exception(exc)
    print(f"{prog}: error: {error_line(exc, (ConfigError, LighthouseUnreachable))}",
          file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _DEBUG_FLAG in argv
    argv = [a for a in argv if a != _DEBUG_FLAG]
    if argv and argv[0] == "plan":
        parser = OneLineArgumentParser(prog="python -m trainer plan",
                                       description="Estimate per-GPU memory and pick a layout")
        add_layout_plan_arguments(parser)
        args = parser.parse_args(argv[1:])
        try:
            return run_layout_plan(args)
        except Exception as exc:  # noqa: BLE001 - one line, not a traceback
            return _fail("python -m trainer plan", exc, debug, 2)
    if argv and argv[0] in ("lighthouse", "ft-local"):
        return _ft_command(argv[0], argv[1:], debug)
    try:
        export_torch_env()  # a task of an srun step: RANK & co. from Slurm's variables
    except ValueError as exc:
        return _fail("python -m trainer", exc, debug, EXIT_CONFIG)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("Keys: see docs/config.md (e.g. --training.steps=100 --parallel.tp=2 "
              "--checkpoint.root=/tmp/ckpt --checkpoint.interval=auto)")
        return 0
    try:
        cfg = config_from_argv(argv)
        preemption = Preemption(cfg.fault.preemption_grace_seconds)
        if cfg.fault.handle_preemption:  # from here a preemption is answered, not fatal
            preemption.install()
        check_startup(cfg)
        if cfg.fault_tolerance.enabled:  # before anything is built: fail fast, in one line
            check_reachable(cfg.fault_tolerance)
    except Exception as exc:  # noqa: BLE001 - bad input is one line, not a traceback
        return _fail("python -m trainer", exc, debug,
                     EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILED)
    # Before the process group, which starts CUDA: cuBLAS reads its workspace setting then.
    apply_determinism(cfg.training.deterministic)
    env = init_distributed(cfg.training.resolved_device(),
                           timeout_seconds=cfg.process_group_timeout_seconds())
    try:
        code = run(cfg, env, preemption)
    except Exception as exc:  # noqa: BLE001 - e.g. a peer died mid-collective
        # Leave through shutdown all the same: a traceback exit runs the interpreter's
        # finalizers, which can abort in a gloo thread and replace our exit code.
        if debug:
            traceback.print_exception(exc)
        logging.getLogger("trainer").error("training failed: %s", error_line(exc))
        shutdown(env, EXIT_FAILED, barrier=False)
    shutdown(env, code)
    return code  # not reached: shutdown leaves the process


def _ft_command(name: str, argv: list[str], debug: bool) -> int:
    """lighthouse: serve one until SIGTERM; ft-local: see trainer.ft.local."""
    prog = f"python -m trainer {name}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{name}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("lighthouse: listens on fault_tolerance.lighthouse_bind (default 127.0.0.1, "
              "this host only; on several hosts the address the groups reach it by) at the "
              "port of fault_tolerance.lighthouse, with its min_replicas, "
              "heartbeat_timeout_seconds and join_timeout_seconds; ft-local's listens on "
              "127.0.0.1")
        return 0
    try:
        if name == "lighthouse":
            return serve(config_from_argv(argv).fault_tolerance)
        from trainer.ft.local import main as local_main

        return local_main(argv)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        return _fail(prog, exc, debug, EXIT_CONFIG if isinstance(exc, ConfigError) else 1)


if __name__ == "__main__":
    sys.exit(main())
