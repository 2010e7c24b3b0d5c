"""``python -m trainer --config FILE [--section.key=value ...]`` and ``python -m trainer plan``.

Runs under torchrun (one process per rank) or alone (one process, no torchrun needed).
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        import argparse

        from trainer.layout_plan import add_plan_arguments, run_plan

        parser = argparse.ArgumentParser(prog="python -m trainer plan",
                                         description="Estimate per-GPU memory and pick a layout")
        add_plan_arguments(parser)
        return run_plan(parser.parse_args(argv[1:]))
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from trainer.config import ConfigError, config_from_argv
    from trainer.distributed import EXIT_CONFIG, EXIT_FAILED, init_distributed, shutdown
    from trainer.train import run

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("Keys: see docs/config.md (e.g. --training.steps=100 --parallel.tp=2 "
              "--checkpoint.root=/tmp/ckpt --checkpoint.interval=auto)")
        return 0
    try:
        cfg = config_from_argv(argv)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    env = init_distributed(cfg.training.resolved_device())
    try:
        code = run(cfg, env)
    except Exception:  # noqa: BLE001 - e.g. a peer died mid-collective
        # Leave through shutdown all the same: a traceback exit runs the interpreter's
        # finalizers, which can abort in a gloo thread and replace our exit code.
        logging.getLogger("trainer").exception("training failed")
        shutdown(env, EXIT_FAILED, barrier=False)
    shutdown(env, code)
    return code  # not reached: shutdown leaves the process


if __name__ == "__main__":
    sys.exit(main())
