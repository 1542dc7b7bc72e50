#!/bin/bash
# One flying-worker per GPU of this node, each on its own GPU and port. The pod worker-K holds engines
# K*GPUS_PER_NODE .. K*GPUS_PER_NODE+GPUS_PER_NODE-1 (indices are cluster-wide) and announces its node
# (NODE_NAME). The pod's engines are one pool of their own: with COMM_PORT set they build its communicators (NCCL
# over NVLink) with the rendezvous on the pod's first engine at COMM_HOST, and groups bind inside the node only.
#   worker.sh          start the engines; SIGTERM drains every engine (each leaves the live set, lets its
#                      assigned requests finish), and the pod ends once all have stopped
#   worker.sh probe    exit 0 if every engine's SGLang server answers /health
set -u
gpus="${GPUS_PER_NODE}"
if [ "${1:-}" = "probe" ]; then
  exec python - "${gpus}" "${ENGINE_PORT}" <<'PY'
import sys, urllib.request
n, port = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    urllib.request.urlopen(f"http://127.0.0.1:{port + i}/health", timeout=5)
PY
fi
ordinal="${POD_NAME##*-}"
first=$(( ordinal * gpus ))
pids=()
stop() { kill -TERM "${pids[@]}" 2>/dev/null; wait; exit 0; }
trap stop TERM INT  # before the first engine starts: a SIGTERM at any time drains what runs
for (( i = 0; i < gpus; i++ )); do
  comm=()
  if [ -n "${COMM_PORT:-}" ]; then comm=(--comm-port "${COMM_PORT}" --comm-host "${COMM_HOST}"); fi
  CUDA_VISIBLE_DEVICES="${i}" flying-worker --engine "$(( first + i ))" --num-engines "${gpus}" \
    --first-engine "${first}" --node "${NODE_NAME:-${POD_NAME}}" --model-path "${MODEL_PATH}" --served-model-name "${MODEL_NAME}" --host "${POD_IP}" \
    --port "$(( ENGINE_PORT + i ))" --device cuda --dtype bfloat16 --enable-metrics \
    --drain-grace-s "${DRAIN_GRACE_S}" --log-format json "${comm[@]}" &
  pids+=("$!")
done
wait -n  # an engine exited on its own: stop the others, the pod restarts as a whole (its pool with it)
rc=$?
kill -TERM "${pids[@]}" 2>/dev/null
wait
exit $(( rc == 0 ? 1 : rc ))
