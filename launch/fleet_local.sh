#!/usr/bin/env bash
# A learner and N generation servers on this machine: the fleet (docs/fleet.md) in one command.
#
#   launch/fleet_local.sh configs/tiny.yaml 2 run.dir=runs/fleet rollout.prompts_per_step=8
#
# Starts N `async-rl serve --port 0` (loopback, each on a free port), waits for each to print
# `serving on URL` (at most SERVE_TIMEOUT seconds, default 600), writes the URLs to a servers
# file in a fresh temporary folder (with the servers' logs), then runs `async-rl train` with
# engine.backend=remote engine.servers_file=that file. The overrides go to the servers and the
# trainer alike: a server must have the trainer's model, tokenizer and sampling. The servers
# read each weights version from run.dir/fleet_weights, which the trainer writes.
# SIGINT or SIGTERM: the trainer gets SIGTERM (it saves at the next step boundary and exits 0);
# on any exit the servers get SIGTERM (SIGKILL 30 s later). Exits with the trainer's status.
# PYTHON (default .venv/bin/python) runs async_rl. Every process uses every device it sees: on
# an accelerator host give each its own (CUDA_VISIBLE_DEVICES, ...) or run them on the CPU.
set -euo pipefail
set -m  # each child in a process group of its own: a terminal's Ctrl-C reaches this script only
cd "$(dirname "$0")/.."
usage="usage: launch/fleet_local.sh CONFIG NUM_SERVERS [overrides...]"
CONFIG=${1:?$usage}
N=${2:?$usage}
shift 2
[[ $N =~ ^[1-9][0-9]*$ ]] || { echo "$usage (NUM_SERVERS: a positive integer, not '$N')" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
dir=$(mktemp -d "${TMPDIR:-/tmp}/async_rl_fleet.XXXXXX")
servers=()
trainer=""

alive() {
  local p
  for p in "${servers[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}
stop_servers() {
  local rc=$? t p
  trap - EXIT
  set +e
  ((${#servers[@]})) && kill -TERM "${servers[@]}" 2>/dev/null
  for ((t = 0; t < 60; t++)); do alive || break; sleep 0.5; done
  alive && kill -KILL "${servers[@]}" 2>/dev/null
  for p in "${servers[@]}"; do wait "$p" 2>/dev/null; done
  if ((rc == 0)); then rm -rf "$dir"; else echo "fleet_local: servers' logs in $dir" >&2; fi
  exit "$rc"
}
on_signal() {  # one SIGTERM to the trainer per signal (a second one stops it at once, as its own would)
  if [[ -n $trainer ]]; then kill -TERM "$trainer" 2>/dev/null || true; else exit 130; fi
}
trap stop_servers EXIT
trap on_signal INT TERM

for ((i = 0; i < N; i++)); do
  "$PY" -m async_rl serve --config "$CONFIG" --port 0 "$@" >"$dir/server$i.log" 2>&1 &
  servers+=($!)
done
deadline=$((SECONDS + ${SERVE_TIMEOUT:-600}))
for ((i = 0; i < N; i++)); do
  until url=$(sed -n '/^serving on /{s///p;q;}' "$dir/server$i.log") && [[ -n $url ]]; do
    if ! kill -0 "${servers[i]}" 2>/dev/null; then
      tail -n 20 "$dir/server$i.log" >&2
      echo "fleet_local: server $i exited before serving" >&2
      exit 1
    fi
    if ((SECONDS >= deadline)); then
      tail -n 20 "$dir/server$i.log" >&2
      echo "fleet_local: server $i did not serve within ${SERVE_TIMEOUT:-600} s" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "fleet_local: server $i (pid ${servers[i]}) serving on $url, log $dir/server$i.log"
  echo "$url" >>"$dir/servers.tmp"
done
mv "$dir/servers.tmp" "$dir/servers.txt"  # whole: the trainer re-reads it every 2 s

"$PY" -m async_rl train --config "$CONFIG" "$@" engine.backend=remote "engine.servers_file=$dir/servers.txt" &
trainer=$!
while :; do
  rc=0
  wait "$trainer" || rc=$?
  kill -0 "$trainer" 2>/dev/null || break  # else a signal interrupted the wait: wait again
done
exit "$rc"
