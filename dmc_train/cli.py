"""Shared wiring for the Hydra entry points in ``launch/``: config pre-check and one-line errors.

Hydra's own error report spans several lines and a hint about HYDRA_FULL_ERROR; users get one line
naming the cause instead, and a non-zero exit. Nothing is written before the config is valid.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from dmc_train.errors import TrainingDiverged, UserError, one_line

EXIT_USER_ERROR = 2


def precheck(argv: list[str], config_name: str = "config") -> None:
    """Compose the config from the command line's overrides; exit with one line if it is invalid."""
    from dmc_train.recipes import load_config

    overrides = [a for a in argv if not a.startswith("-") and not a.startswith("hydra")]
    try:
        load_config(overrides, config_name)
    except Exception as e:  # hydra/omegaconf raise a family of types; all are user config errors here
        fail(f"config error: {one_line(e)}")


EXIT_DIVERGED = 3


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_reporting_errors(fn: Callable[[], None]) -> None:
    """Run ``fn``; user-facing errors (bad config, bad checkpoint) end in one line and exit code 2."""
    try:
        fn()
    except (UserError, FileNotFoundError) as e:
        fail(str(e))
    except TrainingDiverged as e:
        fail(str(e), EXIT_DIVERGED)
