"""Shared wiring of the entry points (``launch/*``, ``checkpoints_tools/*``): Hydra start-up,
config pre-check, one-line errors and exit codes.

Only entry points import this module; the library never does (it raises the types of
:mod:`dmc_train.errors` and leaves printing and exiting to its caller). It lives in the package,
not in ``launch/``, because the converters in ``checkpoints_tools/`` use it too.

Hydra's own error report spans several lines and a hint about HYDRA_FULL_ERROR; users get one line
naming the cause instead, and a non-zero exit. Nothing is written before the config is valid.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from typing import Any, Callable

from dmc_train.errors import ConfigError, TrainingDiverged, UserError, one_line

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
# Under torchrun the first rank to exit gets the others killed: ranks other than 0 wait this long before
# reporting their error, so an error every rank hits is printed once, by rank 0 (ranks start and check
# their config independently, seconds apart on a loaded machine).
OTHER_RANKS_WAIT_S = 10.0


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
    (training) every rank also validates the config for its world size and checks that the run directory
    is writable, and a single process takes the run directory's lock, all before Hydra starts (the
    training loop takes the lock on every layout). Hydra writes nothing into the run directory
    (``recipes/config.yaml``), so a rejected run leaves nothing behind.
    """
    import hydra

    from dmc_train.distributed import silence_expected_warnings
    from dmc_train.recipes import recipes_dir, register_schema

    silence_expected_warnings()  # before anything imports megatron-core
    register_schema()
    cfg = precheck(sys.argv[1:], config_name)
    if lock_run_dir and cfg is not None:
        check_before_hydra(cfg)
    hydra.main(config_path=recipes_dir(), config_name=config_name, version_base=None)(task)()


def check_before_hydra(cfg: Any) -> None:
    """Every rank: validate ``cfg`` for the launch's world size and check that the run directory can be
    written; a single process also takes ``cfg.run_dir``'s lock now. The lock is skipped when the run
    directory depends on the time (``${now:...}``: Hydra resolves it again) and on several processes
    (the training loop takes the lock and tells every rank)."""
    from omegaconf import OmegaConf

    from dmc_train.distributed import read_launch_env
    from dmc_train.recipes import validate
    from dmc_train.training import run_lock

    world_size = read_launch_env().world_size
    try:
        validate(cfg, world_size)
        check_starting_weights(cfg)
        if "${now:" in OmegaConf.to_yaml(cfg):
            return
        run_lock.check_writable(cfg.run_dir)
        if world_size == 1:
            run_lock.acquire(cfg.run_dir)
    except UserError as e:
        fail(f"config error: {e}" if isinstance(e, ConfigError) else str(e))


def check_starting_weights(cfg: Any) -> None:
    """What a training run starts from: LESS distils from a base model, so a fresh run needs
    ``checkpoint.init_from`` (else the base would be random); a Hugging Face directory there must have a complete
    ``config.json`` and no weights of layers it does not list (:func:`dmc_train.conversion.hf_checks.check_hf_dir`)."""
    init_from = cfg.checkpoint.init_from
    if cfg.method.name == "less" and not init_from and not _continues_a_checkpoint(cfg):
        raise ConfigError("method=less distils from a frozen base model, and checkpoint.init_from is not set (the "
                          "base would be random); set checkpoint.init_from=<a run, checkpoint or Hugging Face Llama "
                          "directory>")
    from dmc_train.training.hf_loading import is_hf_dir

    if init_from and is_hf_dir(init_from):
        from dmc_train.conversion.hf_checks import check_hf_dir

        check_hf_dir(init_from)


def _continues_a_checkpoint(cfg: Any) -> bool:
    """Whether the run resumes a checkpoint (``checkpoint.resume``: a path, or ``auto`` with one in the run
    directory): a LESS checkpoint names its own base."""
    from dmc_train.training.checkpoint_dirs import checkpoint_root, newest_complete

    resume = cfg.checkpoint.resume
    return resume not in ("auto", "none") or (resume == "auto" and newest_complete(checkpoint_root(cfg)) is not None)


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank and _stopped_by_torchrun(OTHER_RANKS_WAIT_S):  # rank 0 reported the error: see OTHER_RANKS_WAIT_S
        _exit(code)
    print(f"error: {message}" + (f" (rank {rank})" if rank else ""), file=sys.stderr, flush=True)
    _exit(code)


def _stopped_by_torchrun(wait_s: float) -> bool:
    """Whether SIGTERM (torchrun stopping the other ranks when one fails) came already or comes within
    ``wait_s``. The stop-signal recorder (``preemption.catch_early``) keeps its handler: replacing a Python
    handler loses a signal that arrived but was not handled yet. Without a recorder SIGTERM's default action
    ends this rank during the wait."""
    recorder = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if not hasattr(recorder, "seen"):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a mask inherited from the node wrapper
    deadline = time.monotonic() + wait_s
    while signal.SIGTERM not in getattr(recorder, "seen", ()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _exit(code: int) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # At once: the process group's teardown at exit can wait for the other ranks. Helper processes
        # (megatron's checkpoint writer) would outlive an os._exit, holding the job's output open.
        for child in multiprocessing.active_children():
            child.terminate()
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def run_reporting_errors(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` and return what it returns; user-facing errors (bad config, bad checkpoint, a file system error
    such as a full disk) end in one line and exit code 2."""
    from dmc_train.distributed import silence_expected_warnings

    silence_expected_warnings()
    try:
        return fn()
    except (UserError, OSError) as e:
        fail(str(e))
    except TrainingDiverged as e:
        fail(str(e), EXIT_DIVERGED)
