#!/usr/bin/env bash
# A rolling update from one checkpoint to another behind one router, with no failed
# request: v1's prefill and decode workers serve; v2's join beside them (the router
# holds both versions, keyed by model fingerprint, and never pairs a v1 worker with a
# v2 one); once v2 has both roles live, new requests go to v2 and running ones finish
# on v1; then v1's workers are stopped.
#
#   bash launch/rolling_update.sh OLD_DIR NEW_DIR
#
# Both checkpoints must share the tokenizer (the router tokenizes for every worker; a
# worker with another is refused). Watch the router's lines: "new requests go to model
# <fingerprint>" names the version serving; /health shows it too.
set -euo pipefail
OLD=${1:?old checkpoint}; NEW=${2:?new checkpoint}
ROUTER_PORT=${ROUTER_PORT:-50051}
INTERNAL_PORT=${INTERNAL_PORT:-50052}
HTTP_PORT=${HTTP_PORT:-8000}
COMMON=(--host 127.0.0.1 --max_model_len "${MAX_MODEL_LEN:-512}" --port 0
        --router "127.0.0.1:${INTERNAL_PORT}")

pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait; }
trap cleanup EXIT INT TERM
health() { curl -s "http://127.0.0.1:${HTTP_PORT}/health"; echo; }

python -m jaxpd.launch --role router --model "$OLD" --port "${ROUTER_PORT}" \
    --internal_port "${INTERNAL_PORT}" --http_port "${HTTP_PORT}" --host 127.0.0.1 \
    & pids+=($!)
python -m jaxpd.launch --role prefill --mesh prefill=2 --model "$OLD" "${COMMON[@]}" &
old_prefill=$!
python -m jaxpd.launch --role decode --mesh decode=2 --model "$OLD" "${COMMON[@]}" &
old_decode=$!
pids+=("$old_prefill" "$old_decode")
echo "v1 starting; send load now, e.g.:"
echo "  while :; do python -m jaxpd.client 'The list type' --target 127.0.0.1:${ROUTER_PORT}; done"
read -r -p "press Enter to start v2 ... "
python -m jaxpd.launch --role prefill --mesh prefill=2 --model "$NEW" "${COMMON[@]}" &
pids+=($!)
python -m jaxpd.launch --role decode --mesh decode=2 --model "$NEW" "${COMMON[@]}" &
pids+=($!)
read -r -p "press Enter once /health names v2's fingerprint, to retire v1 ... "
health
# New requests go to v2 from then on; a request already running on v1 finishes there.
# Give the longest of them time to end (max_tokens decode steps), then stop v1: a
# worker on SIGTERM takes no new call and lets those it holds finish within its grace.
sleep "${V1_DRAIN_S:-10}"
kill -TERM "$old_prefill" "$old_decode"
wait "$old_prefill" "$old_decode" || true
echo "v1 retired"; health
wait -n
