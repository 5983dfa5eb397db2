#!/usr/bin/env bash
# The multi-machine recipe on one machine: 2 standalone shards and 2 workers,
# each given its TF_CONFIG by hand, as on separate machines.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P0=$(free_port); P1=$(free_port)
keras-geeps shard --bind tcp://127.0.0.1:$P0 --shard-id 0 --num-shards 2 --num-workers 2 & S0=$!
keras-geeps shard --bind tcp://127.0.0.1:$P1 --shard-id 1 --num-shards 2 --num-workers 2 & S1=$!
trap 'kill $S0 $S1 2>/dev/null || true' EXIT
pids=()
for i in 0 1; do
  TF_CONFIG='{"cluster": {"ps": ["127.0.0.1:'$P0'", "127.0.0.1:'$P1'"], "worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": '$i'}}' \
    $PY examples/custom_loop.py --epochs "${EPOCHS:-2}" "$@" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
keras-geeps stats --shards 127.0.0.1:$P0,127.0.0.1:$P1 | sed -n 1,5p  # (reads all: no broken pipe)
keras-geeps stop --shards 127.0.0.1:$P0,127.0.0.1:$P1
