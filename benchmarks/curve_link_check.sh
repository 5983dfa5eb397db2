#!/usr/bin/env bash
# CURVE vs plain over an emulated link between two network namespaces.
#
# Usage (root: it creates namespaces kgA/kgB and a veth pair, then removes
# them): bash benchmarks/curve_link_check.sh [RATE ...]   e.g. 25gbit 10gbit
# With no RATE the veth link is unshaped. Each line: the median 16 MB round
# trip (2 MiB frames, raw pyzmq, 2 I/O threads) plain, with libzmq's CURVE,
# and with keras_geeps's sealed data channel (AEGIS-256X4, benchmarks/_echo.py),
# and the ratios to plain. It tells whether CURVE's cost here is a loopback
# artefact (it is not: the veth link shares the same two cores) and what
# the sealed channel keeps of a link's speed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
cleanup() { ip netns del kgA 2>/dev/null || true; ip netns del kgB 2>/dev/null || true; }
trap cleanup EXIT
setup() {
  cleanup
  ip netns add kgA; ip netns add kgB
  ip link add kga type veth peer name kgb
  ip link set kga netns kgA; ip link set kgb netns kgB
  ip -n kgA addr add 10.213.0.1/24 dev kga; ip -n kgB addr add 10.213.0.2/24 dev kgb
  for ns in kgA kgB; do ip -n $ns link set lo up; done
  ip -n kgA link set kga up; ip -n kgB link set kgb up
  if [ -n "$1" ]; then
    ip netns exec kgA tc qdisc add dev kga root tbf rate "$1" burst 4mb latency 50ms
    ip netns exec kgB tc qdisc add dev kgb root tbf rate "$1" burst 4mb latency 50ms
  fi
}
round_trip() {  # $1: plain, curve or sealed; prints the median ms
  ip netns exec kgA "$PY" benchmarks/_echo.py serve tcp://10.213.0.1:5555 "$1" &
  local server=$!
  sleep 1
  ip netns exec kgB "$PY" benchmarks/_echo.py ask tcp://10.213.0.1:5555 "$1"
  wait $server
}
for rate in "${@:-}"; do
  setup "$rate"
  plain=$(round_trip plain); curve=$(round_trip curve)
  sealed=$(round_trip sealed)
  echo "link ${rate:-unshaped}: plain ${plain} ms, CURVE ${curve} ms" \
       "($(python3 -c "print(round($plain / $curve, 3))") of plain)," \
       "sealed ${sealed} ms ($(python3 -c "print(round($plain / $sealed, 3))"))"
done
