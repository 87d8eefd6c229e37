#!/usr/bin/env bash
# Run async_rl on every worker of a Cloud TPU pod slice (one process per host).
#
#   launch/tpu_pod.sh TPU_NAME ZONE --config configs/qwen2.5-0.5b.yaml run.dir=gs://my-bucket/runs/x ...
#
# Needs: the repository at the same path on every worker (REPO, default ~/async_rl), its
# .venv made with `make venv` plus `pip install -U "jax[tpu]==0.10.2"` and
# `pip install -c constraints.txt -e ".[gcs]"`, and run.dir where every worker reaches it:
# a gs:// prefix (the workers' service account needs read/write on the bucket; see the README,
# "Run directories on object storage") or a filesystem all workers share (Filestore).
# Checkpoints are written collectively; process i > 0 writes its own lineage.p<i>.jsonl
# and holds its own lease .lock.p<i>. `.venv/bin/async-rl audit gs://my-bucket/runs/x` checks it.
# jax.distributed.initialize() finds the coordinator and process ids from the TPU metadata.
# Preemption: the TPU maintenance event sends SIGTERM; the run saves at the next step
# boundary and exits 0; rerun this script to resume.
set -euo pipefail
TPU=${1:?usage: launch/tpu_pod.sh TPU_NAME ZONE [train args...]}
ZONE=${2:?usage: launch/tpu_pod.sh TPU_NAME ZONE [train args...]}
shift 2
REPO=${REPO:-\~/async_rl}
ARGS=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command \
  "cd $REPO && ASYNC_RL_DISTRIBUTED=1 .venv/bin/async-rl train $ARGS"
