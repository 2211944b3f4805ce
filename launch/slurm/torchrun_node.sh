#!/bin/bash
pending=""  # first: the stop signals received and not yet handed to the ranks (see below)
trap 'pending="$pending USR1"' USR1
trap 'pending="$pending TERM"' TERM
# Per-node launcher (one srun task per node): `bash torchrun_node.sh <torchrun args>`. The sbatch
# script of launch/submit.py inlines this text and runs it as `bash -c "$NODE_WRAPPER" torchrun_node.sh
# <torchrun args>` (same behaviour; no file needed on the compute nodes).
#
# Why a wrapper: Slurm signals the processes of the job step: with proctrack/cgroup every process
# (this wrapper, torchrun, the ranks), with proctrack/pgid only this task's process group (this
# wrapper and torchrun: torchrun starts each rank in its own session). The ranks must get every stop
# signal (SIGUSR1: Slurm's time-limit warning; SIGTERM: scancel, time limit, preemption), whenever it
# comes, and torchrun must outlive the ranks' checkpoint. So:
#   * This wrapper owns the stop signals. It records each one from its first line on and hands it to
#     torchrun's children (the ranks) as soon as they exist: at once while they run, or, when the signal
#     comes before torchrun has started them, the moment they appear (it looks every 0.2 s until then).
#   * torchrun runs with SIGUSR1 and SIGTERM blocked (held pending, never acted on: torchrun has no
#     SIGUSR1 handler and would die of it, and it would turn a SIGTERM into an exit 1). The ranks inherit
#     the mask, so a signal that reaches a rank before its handler exists waits: the trainer's handler
#     (dmc_train.training.preemption, installed on the entry point's first line) unblocks and gets it.
#   A rank that gets a signal twice (cgroup: directly and relayed) is fine: its handler only sets a flag.
#   SIGINT reaches torchrun directly; the wrapper keeps waiting so the task ends with torchrun's exit
#   status after torchrun has shut its ranks down.
#   The gaps, each well under a millisecond: before the first line below runs, and the instant this shell
#   forks torchrun, when both ignore the signals so that the child cannot die of one before it blocks them.
set -u
if ! command -v python3 >/dev/null; then  # starts torchrun with the signals blocked (bash cannot block)
  echo "error: torchrun_node.sh needs python3 on PATH (the environment that provides torchrun)" >&2
  exit 2
fi
START_BLOCKED='import os, signal, sys
stop = {signal.SIGUSR1, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # inherited by exec and by the ranks torchrun starts
for sig in stop:
    signal.signal(sig, signal.SIG_DFL)  # blocked: nothing is delivered; a pending one stays pending
os.execvp(sys.argv[1], sys.argv[1:])'
# The interpreter itself, not a launcher in front of it: a launcher that runs helper processes before it execs
# python (a pyenv shim) would show them as torchrun's children, which the relay below takes for the ranks. Resolved
# in a subshell that ignores the stop signals (this shell keeps recording them meanwhile). torchrun itself must be
# an executable script of the environment for the same reason (activate the environment rather than a shim).
PYTHON=$(trap '' USR1 TERM; python3 -c 'import sys; print(sys.executable)')
pid=""
relay() {  # hand the pending signals to the ranks, once torchrun has started them
  [ -n "$pending" ] && [ -n "$pid" ] && pgrep -P "$pid" >/dev/null 2>&1 || return 0
  local sig sigs="$pending"
  pending=""  # one that comes meanwhile stays pending for the next call
  for sig in $sigs; do
    pkill -"$sig" -P "$pid" 2>/dev/null || true
  done
}
trap '' USR1 TERM
"$PYTHON" -c "$START_BLOCKED" torchrun "$@" &
pid=$!
trap 'pending="$pending USR1"; relay' USR1
trap 'pending="$pending TERM"; relay' TERM
trap ':' INT

# Start-up: until torchrun has started its ranks, look every 0.2 s (a signal meanwhile waits in $pending).
while kill -0 "$pid" 2>/dev/null && ! pgrep -P "$pid" >/dev/null 2>&1; do
  sleep 0.2
done
relay
while true; do
  wait "$pid"  # a trapped signal ends the wait early (its trap has relayed it)
  rc=$?
  kill -0 "$pid" 2>/dev/null || break  # torchrun has exited: rc is its status (or a signal's, see below)
done
if [ "$rc" -gt 128 ]; then  # a signal may have ended the last wait as torchrun exited: ask again
  wait "$pid" 2>/dev/null
  again=$?
  [ "$again" -ne 127 ] && rc=$again
fi
exit "$rc"
