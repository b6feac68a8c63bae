"""The ``postrl`` command line: train, sft, dpo, demo, eval, servers and conversion."""

from __future__ import annotations

import logging
import sys

from postrl.cli.parser import build_parser
from postrl.config.run import ConfigError

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides after an option (`train CONFIG --overwrite steps=2`) arrive here
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from postrl.models.loading import quiet_transformers

    quiet_transformers()
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(  # force: a second main() in one process (a notebook, the tests) logs to today's stderr
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True
    )
    from postrl.controller.failures import RewardFailureError
    from postrl.data import DatasetError
    from postrl.models.weights import WeightSyncError
    from postrl.reward.client import RewardServiceError
    from postrl.rollout.common import EngineUnhealthyError
    from postrl.rollout.pool import RolloutPoolError
    from postrl.run.interrupt import RunInterrupted, leave_now_if_connect_abandoned, leave_now_if_threads_hang
    from postrl.train.group import TrainWorkerDiedError
    from postrl.train.optimization import NonFiniteLossError
    from postrl.workers.handles import PlacementError

    try:
        return args.func(args)
    except RunInterrupted as exc:
        print(f"postrl {args.command}: {exc}", file=sys.stderr)
        leave_now_if_threads_hang(exc.exit_code, exc.grace_s)
        return exc.exit_code
    except KeyboardInterrupt:  # before a run's own handler is installed (loading, validating): nothing written yet
        print(f"\npostrl {args.command}: interrupted", file=sys.stderr)
        return 130
    except (
        ConfigError,
        DatasetError,
        EngineUnhealthyError,
        FileNotFoundError,
        NonFiniteLossError,
        RewardFailureError,
        PlacementError,
        RewardServiceError,
        RolloutPoolError,
        TrainWorkerDiedError,
        WeightSyncError,
    ) as exc:
        print(f"postrl {args.command}: error: {exc}", file=sys.stderr)
        leave_now_if_connect_abandoned(2)
        return 2
