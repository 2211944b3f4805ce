#!/bin/bash
# Per-node launcher (one srun task per node): `bash torchrun_node.sh <torchrun args>`. The sbatch
# script of launch/submit.py inlines this text and runs it as `bash -c "$NODE_WRAPPER" torchrun_node.sh
# <torchrun args>` (same behaviour; no file needed on the compute nodes).
#
# Why a wrapper: Slurm's `--signal=USR1@N` (without "B:") sends SIGUSR1 to the processes of the job
# step. torchrun installs no SIGUSR1 handler, so the default action would kill it - and with it the
# trainer ranks, before they could checkpoint. So:
#   * torchrun starts with SIGUSR1 ignored (an ignored signal is inherited across exec; the ranks
#     re-enable it by installing their own handler, dmc_train.training.preemption);
#   * this wrapper forwards SIGUSR1 to torchrun's children (the ranks; torchrun starts each in its own
#     session, so a signal to this task's process group alone would miss them). Where Slurm signals
#     every process of the step (proctrack/cgroup) the ranks get it twice: harmless, it sets a flag.
#   * SIGTERM/SIGINT reach torchrun directly (same process group); the wrapper keeps waiting so the
#     task ends with torchrun's exit status after torchrun has shut its ranks down.
set -u
trap '' USR1
torchrun "$@" &
pid=$!
trap 'pkill -USR1 -P "$pid" 2>/dev/null || true' USR1
trap ':' TERM INT
while true; do
  wait "$pid"
  rc=$?
  kill -0 "$pid" 2>/dev/null || break  # torchrun has exited: rc is its status
done
exit "$rc"
