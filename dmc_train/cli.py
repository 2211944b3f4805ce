"""Shared wiring of the entry points (``launch/*``, ``checkpoints_tools/*``): Hydra start-up,
config pre-check, one-line errors and exit codes.

Only entry points import this module; the library never does (it raises the types of
:mod:`dmc_train.errors` and leaves printing and exiting to its caller). It lives in the package,
not in ``launch/``, because the converters in ``checkpoints_tools/`` use it too.

Hydra's own error report spans several lines and a hint about HYDRA_FULL_ERROR; users get one line
naming the cause instead, and a non-zero exit. Nothing is written before the config is valid.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from dmc_train.errors import TrainingDiverged, UserError, one_line

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


def precheck(argv: list[str], config_name: str = "config") -> Any:
    """Compose the config from the command line's overrides; exit with one line if it is invalid.

    ``argv`` is read with Hydra's own argument parser (so ``--cfg job`` is a flag and its value, not
    an override). Hydra's informational flags, ``--multirun`` (sweeps, composed per job by Hydra) and
    other config locations (``--config-path``, ``--config-dir``) skip the check; overrides of Hydra's
    own settings (``hydra.*``, ``hydra/...``) are left out. Returns the composed config (None if skipped).
    """
    from hydra._internal.utils import get_args_parser

    from dmc_train.recipes import load_config

    args, _ = get_args_parser().parse_known_args(argv)
    if (args.help or args.hydra_help or args.shell_completion or args.info or args.multirun or args.config_path
            or args.config_dir or args.experimental_rerun):
        return None
    overrides = [a for a in args.overrides if not a.startswith("hydra")]
    try:
        return load_config(overrides, args.config_name or config_name)
    except Exception as e:  # hydra/omegaconf raise a family of types; all are user config errors here
        fail(f"config error: {one_line(e)}")


def hydra_main(task: Callable[[Any], None], config_name: str = "config", lock_run_dir: bool = False) -> None:
    """Run ``task(cfg)`` as a Hydra app on the command line's overrides.

    The config is ``<recipes_dir()>/<config_name>.yaml`` (:func:`dmc_train.recipes.recipes_dir`:
    the checkout's ``recipes/`` or the installed package's copy), so the entry point works as
    ``python launch/<name>.py``, ``python -m launch.<name>``, under ``torchrun`` and as a console
    script. An invalid config ends in one line (exit code 2) before Hydra starts. With ``lock_run_dir``
    a single process takes the run directory's lock before Hydra writes into it, and a run directory in
    use by another run ends in one line (the training loop takes the lock on every layout).
    """
    import hydra

    from dmc_train.distributed import silence_expected_warnings
    from dmc_train.recipes import recipes_dir, register_schema

    silence_expected_warnings()  # before anything imports megatron-core
    register_schema()
    cfg = precheck(sys.argv[1:], config_name)
    if lock_run_dir and cfg is not None:
        lock_before_hydra(cfg)
    hydra.main(config_path=recipes_dir(), config_name=config_name, version_base=None)(task)()


def lock_before_hydra(cfg: Any) -> None:
    """A single process: take ``cfg.run_dir``'s lock now, so a run directory in use fails before Hydra
    writes its output there. Skipped when the run directory depends on the time (``${now:...}``: Hydra
    resolves it again) and on several processes (the training loop takes the lock and tells every rank)."""
    from omegaconf import OmegaConf

    from dmc_train.distributed import read_launch_env
    from dmc_train.training import run_lock

    if read_launch_env().world_size != 1 or "${now:" in OmegaConf.to_yaml(cfg):
        return
    try:
        run_lock.acquire(cfg.run_dir)
    except UserError as e:
        fail(str(e))


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_reporting_errors(fn: Callable[[], None]) -> None:
    """Run ``fn``; user-facing errors (bad config, bad checkpoint) end in one line and exit code 2."""
    from dmc_train.distributed import silence_expected_warnings

    silence_expected_warnings()
    try:
        fn()
    except (UserError, FileNotFoundError) as e:
        fail(str(e))
    except TrainingDiverged as e:
        fail(str(e), EXIT_DIVERGED)
