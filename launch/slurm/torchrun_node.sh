#!/bin/bash
# Per-node launcher (one srun task per node): `bash torchrun_node.sh <torchrun args>`. The sbatch
# script of launch/submit.py inlines this text and runs it as `bash -c "$NODE_WRAPPER" torchrun_node.sh
# <torchrun args>` (same behaviour; no file needed on the compute nodes).
#
# Why a wrapper: Slurm signals the processes of the job step: with proctrack/cgroup every process
# (this wrapper, torchrun, the ranks), with proctrack/pgid only this task's process group (this
# wrapper and torchrun: torchrun starts each rank in its own session). The ranks must get every stop
# signal, and torchrun must outlive the ranks' checkpoint. So:
#   * SIGUSR1 (`--signal=USR1@N`): torchrun has no handler of its own and would die of it, so it starts
#     with SIGUSR1 ignored (inherited across exec; the ranks turn it back on with their own handler,
#     dmc_train.training.preemption) and this wrapper hands the signal to torchrun's children (the ranks).
#   * SIGTERM (scancel, time limit, preemption): torchrun forwards it to the ranks itself, then exits 1
#     once they have checkpointed; this wrapper hands it to the ranks as well, so a SIGTERM that reaches
#     the wrapper alone also stops them.
#   A rank that gets a signal twice (cgroup: directly and relayed) is fine: its handler only sets a flag.
#   SIGINT reaches torchrun directly; the wrapper keeps waiting so the task ends with torchrun's exit
#   status after torchrun has shut its ranks down.
set -u
trap '' USR1
torchrun "$@" &
pid=$!
trap 'pkill -USR1 -P "$pid" 2>/dev/null || true' USR1
trap 'pkill -TERM -P "$pid" 2>/dev/null || true' TERM
trap ':' INT
while true; do
  wait "$pid"
  rc=$?
  kill -0 "$pid" 2>/dev/null || break  # torchrun has exited: rc is its status
done
exit "$rc"
