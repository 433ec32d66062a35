#!/usr/bin/env bash
# A prefill role whose mesh spans two processes (2 x 2 CPU virtual devices = prefill=4,
# tensor parallel across the processes through jax.distributed and gloo), a decode
# role whose mesh spans two more (2 x 1 device = decode=2, one dp shard per process)
# and the router, all on this machine. Ctrl-C stops them all.
#
#   bash launch/local_multiprocess_mesh.sh [--model DIR]    (default: the built-in model)
#   python -m jaxpd.client "The list type" --target 127.0.0.1:50051
set -euo pipefail
ROUTER_PORT=${ROUTER_PORT:-50051}
INTERNAL_PORT=${INTERNAL_PORT:-50052}
COORDINATOR=${COORDINATOR:-127.0.0.1:50053}  # the prefill leader's jax.distributed service
DECODE_COORDINATOR=${DECODE_COORDINATOR:-127.0.0.1:50054}  # the decode leader's
COMMON=(--host 127.0.0.1 --max_model_len "${MAX_MODEL_LEN:-512}" "$@")

pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait; }
trap cleanup EXIT INT TERM

python -m jaxpd.launch --role router --port "${ROUTER_PORT}" \
    --internal_port "${INTERNAL_PORT}" "${COMMON[@]}" & pids+=($!)
for id in 0 1; do      # process 0 leads (registers, schedules); 1 replays its programs
  python -m jaxpd.launch --role prefill --mesh prefill=4 --num_processes 2 --process_id "$id" \
      --coordinator "${COORDINATOR}" --port 0 --router "127.0.0.1:${INTERNAL_PORT}" \
      "${COMMON[@]}" & pids+=($!)
done
for id in 0 1; do      # the same for the decode role: process 0 leads, 1 replays
  python -m jaxpd.launch --role decode --mesh decode=2 --num_processes 2 --process_id "$id" \
      --coordinator "${DECODE_COORDINATOR}" --port 0 --router "127.0.0.1:${INTERNAL_PORT}" \
      "${COMMON[@]}" & pids+=($!)
done
wait -n
