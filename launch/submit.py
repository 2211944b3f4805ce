"""Submit a training recipe as a SLURM batch job (multi-node torchrun, preemption-safe).

    python launch/submit.py +recipe=dmc_7b parallel.tensor=2 --nodes 2 --gpus-per-node 8 \\
        --partition gpu --time 24:00:00 --setup "source .venv/bin/activate" --dry-run
    python -m launch.submit ...                      # same, from an installed package

Positional arguments are launch/pretrain.py's Hydra overrides (exactly one ``+recipe=<name>``).
The config is composed and the layout checked against nodes x GPUs before anything is submitted;
problems end in one line and exit code 2. Without ``--dry-run`` the script is written to the log
directory and submitted with ``sbatch``. The job runs ``torchrun ... -m launch.pretrain`` in
``--workdir`` (default: the current directory) with whatever ``--setup`` activates: it needs
dmc_train installed there, not a checkout. Logic: dmc_train/cluster/slurm.py; guide: docs/CLUSTER.md.
"""

import argparse
import os
import sys

from dmc_train.cluster.slurm import JobSpec, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for launch/pretrain.py, incl. +recipe=<name>")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (= trainer ranks) per node")
    p.add_argument("--time", default="04:00:00", help="time limit per job (requeued jobs get it again)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--constraint", help="node features, e.g. 'a100&80gb'")
    p.add_argument("--cpus-per-task", type=int, help="CPUs for the one task per node: give all cores of a node")
    p.add_argument("--job-name", help="default: the recipe name")
    p.add_argument("--array", help="job array, e.g. 0-3; each task gets ++array_task_id=<id> and run_dir/task_<id>")
    p.add_argument("--log-dir", help="sbatch scripts, <job>-<id>.out and per-job <job>-<id>/ logs "
                                     "(default: <run_dir>/slurm)")
    p.add_argument("--run-dir", help="default: the config's run_dir (a relative one resolves under --workdir)")
    p.add_argument("--signal-seconds", type=int, default=300,
                   help="SIGUSR1 this many seconds before the time limit (0: none); allow for one step + a save")
    p.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=True,
                   help="#SBATCH --requeue (default) or --no-requeue (the job then just ends after its checkpoint)")
    p.add_argument("--port", type=int, help="rendezvous port (default 29500 + job id %% 1000)")
    p.add_argument("--setup", action="append", default=[],
                   help="shell line run before training (repeatable): module load, conda activate, ...")
    p.add_argument("--srun-arg", dest="srun_args", action="append", default=[],
                   help="extra srun option (repeatable), e.g. --container-image=...")
    p.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[],
                   help="extra #SBATCH option (repeatable), e.g. --exclusive or --qos=high")
    p.add_argument("--workdir", default=os.getcwd(),
                   help="the job's working directory on the shared file system: relative run_dir and data "
                        "paths resolve there (default: the current directory, %(default)s)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0,
                   help="warn when the memory estimate exceeds 90%% of it (0: no check)")
    p.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    spec = JobSpec(**{k: v for k, v in vars(args).items() if k != "dry_run"})
    return run(spec, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
