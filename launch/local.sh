#!/usr/bin/env bash
# Run a multi-process job on this machine: N training processes joined through
# jax.distributed on loopback, each with its own forced CPU devices. Useful to try the
# multi-host path (per-process data shards, pumps and ledger shards; one SPMD learner).
#
#   launch/local.sh 2 --config configs/tiny.yaml run.dir=runs/local2 rollout.prompts_per_step=32
#
# Every process gets the same arguments; the run directory is shared.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: launch/local.sh NUM_PROCESSES [train args...]}; shift
DEVICES=${DEVICES_PER_PROCESS:-2}
PORT=${PORT:-$((20000 + RANDOM % 20000))}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
for ((i = 0; i < N; i++)); do
  ASYNC_RL_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT ASYNC_RL_NUM_PROCESSES=$N ASYNC_RL_PROCESS_ID=$i \
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=$DEVICES \
    .venv/bin/async-rl train "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
