#!/usr/bin/env bash
# A learner on one Cloud TPU slice and generation servers on others (docs/fleet.md, "Launching a fleet").
#
#   launch/fleet_tpu_pod.sh LEARNER_TPU ZONE SERVER_TPU[,SERVER_TPU...] CONFIG [overrides...]
#   launch/fleet_tpu_pod.sh rl-learn us-east5-b rl-serve-0,rl-serve-1 configs/qwen2.5-0.5b.yaml \
#       run.dir=gs://my-bucket/runs/x model.hf_path=/home/me/models/Qwen2.5-0.5B-Instruct
#
# Every slice is a single-host one (v5litepod-8, v6e-8, v6e-4, ...): the learner is one process
# (engine.backend=remote refuses a multi-process job) and a server is one process on its host's
# chips; the script refuses a slice with more than one worker.
# It starts `async-rl serve --host 0.0.0.0 --port PORT` (PORT default 8000) on each serving slice
# in the background (log ~/async_rl_serve.log there; a server a previous launch left is stopped
# first), then the learner on LEARNER_TPU with engine.backend=remote and engine.servers listing
# the servers' internal addresses (all slices in one VPC network, PORT open between them). The
# learner waits for servers still building their engines. CONFIG and the overrides go to all:
# a server must have the trainer's model, tokenizer and sampling (one that differs is refused).
# Needs: the repository at REPO (default ~/async_rl) on every slice with its .venv made as for
# launch/tpu_pod.sh (`pip install -c constraints.txt -e ".[fleet,gcs]"`), model files at the
# same path on each, and a gs:// run.dir: the learner writes each weights version under
# run.dir/fleet_weights and the servers read it (the learner's service account writes the
# bucket, the servers' read it).
# SIGINT or SIGTERM here: the learner gets SIGTERM (it saves at the next step boundary and
# exits 0). When the learner has exited, the servers get SIGTERM. Rerun to resume.
set -euo pipefail
set -m  # gcloud in a process group of its own: Ctrl-C reaches this script, which stops the learner
usage="usage: launch/fleet_tpu_pod.sh LEARNER_TPU ZONE SERVER_TPU[,SERVER_TPU...] CONFIG [overrides...]"
LEARNER=${1:?$usage}
ZONE=${2:?$usage}
IFS=, read -ra SERVING <<<"${3:?$usage}"
CONFIG=${4:?$usage}
shift 4
REPO=${REPO:-\~/async_rl}
PORT=${PORT:-8000}
ARGS=$(printf '%q ' --config "$CONFIG" "$@")

ssh_tpu() {  # TPU COMMAND: run COMMAND on the slice's one worker
  gcloud compute tpus tpu-vm ssh "$1" --zone "$ZONE" --worker=0 --command "$2"
}
address() {  # TPU: the internal address of the slice's one worker
  local a
  a=$(gcloud compute tpus tpu-vm describe "$1" --zone "$ZONE" --flatten=networkEndpoints \
      --format='value(networkEndpoints.ipAddress)')
  if [[ $(wc -w <<<"$a") != 1 ]]; then
    echo "fleet_tpu_pod: $1 has workers ${a//$'\n'/ }; each slice must be a single-host one" >&2
    return 1
  fi
  echo "$a"
}
# On a worker: SIGTERM the process whose pid the file names (if it is still async-rl), wait for it.
stop_pid() {
  echo "p=\$(cat \$HOME/$1 2>/dev/null) && grep -q async-rl /proc/\$p/cmdline 2>/dev/null" \
       "&& kill -TERM \$p && for i in \$(seq 120); do kill -0 \$p 2>/dev/null || break; sleep 1; done;" \
       "rm -f \$HOME/$1; true"
}

address "$LEARNER" >/dev/null
urls=()
for tpu in "${SERVING[@]}"; do
  a=$(address "$tpu")
  urls+=("http://$a:$PORT")
done
SERVERS=$(IFS=,; echo "${urls[*]}")

started=()
stop_servers() {
  local rc=$? tpu
  trap - EXIT
  set +e
  for tpu in "${started[@]}"; do ssh_tpu "$tpu" "$(stop_pid async_rl_serve.pid)" & done
  wait
  exit "$rc"
}
trap stop_servers EXIT
for tpu in "${SERVING[@]}"; do
  started+=("$tpu")
  ssh_tpu "$tpu" "$(stop_pid async_rl_serve.pid); cd $REPO || exit 1; setsid nohup .venv/bin/async-rl serve $ARGS \
    --host 0.0.0.0 --port $PORT >\$HOME/async_rl_serve.log 2>&1 </dev/null & echo \$! >\$HOME/async_rl_serve.pid"
done
echo "fleet_tpu_pod: servers $SERVERS"

learner=""
on_signal() {  # the learner's pid is in ~/async_rl_train.pid on its worker
  if [[ -n $learner ]]; then ssh_tpu "$LEARNER" "$(stop_pid async_rl_train.pid)" & else exit 130; fi
}
trap on_signal INT TERM
ssh_tpu "$LEARNER" "cd $REPO && echo \$\$ >\$HOME/async_rl_train.pid && \
  exec .venv/bin/async-rl train $ARGS engine.backend=remote engine.servers=$SERVERS" &
learner=$!
while :; do
  rc=0
  wait "$learner" || rc=$?
  kill -0 "$learner" 2>/dev/null || break  # else a signal interrupted the wait: wait again
done
exit "$rc"
