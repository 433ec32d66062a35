#!/usr/bin/env bash
# Router + 1 prefill + 1 decode process on this machine (CPU virtual devices), KV pages
# moved between the processes by the JAX transfer server. Ctrl-C stops all three.
#
#   bash launch/local_disaggregated.sh [--model DIR]      (default: the built-in model)
#   python -m jaxpd.client "The list type" --target 127.0.0.1:50051
set -euo pipefail
ROUTER_PORT=${ROUTER_PORT:-50051}
INTERNAL_PORT=${INTERNAL_PORT:-50052}   # workers register here (loopback: no token needed)
COMMON=(--host 127.0.0.1 --max_model_len "${MAX_MODEL_LEN:-512}" "$@")

pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait; }
trap cleanup EXIT INT TERM

# Start order does not matter: workers register with the router, retrying with backoff,
# on its internal port, and the router reports SERVING (gRPC health) once a decode
# worker is live.
python -m jaxpd.launch --role prefill --mesh prefill=4 --port 0 \
    --router "127.0.0.1:${INTERNAL_PORT}" "${COMMON[@]}" & pids+=($!)
python -m jaxpd.launch --role decode --mesh decode=4 --port 0 \
    --router "127.0.0.1:${INTERNAL_PORT}" "${COMMON[@]}" & pids+=($!)
python -m jaxpd.launch --role router --port "${ROUTER_PORT}" \
    --internal_port "${INTERNAL_PORT}" "${COMMON[@]}" & pids+=($!)
wait -n
