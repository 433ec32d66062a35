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
# worker with another is refused). Once v2 serves (/health's "fingerprint" names it; the
# router logs "new requests go to model <fingerprint>"), v1 is given V1_DRAIN_S seconds
# and stopped. launch/rolling_update_probe.py runs this under streaming load and checks
# every stream.
set -euo pipefail
OLD=${1:?old checkpoint}; NEW=${2:?new checkpoint}
ROUTER_PORT=${ROUTER_PORT:-50051}
INTERNAL_PORT=${INTERNAL_PORT:-50052}
HTTP_PORT=${HTTP_PORT:-8000}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-512}
COMMON=(--host 127.0.0.1 --max_model_len "${MAX_MODEL_LEN}" --port 0
        --router "127.0.0.1:${INTERNAL_PORT}")

pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait; }
trap cleanup EXIT INT TERM
health() { curl -s "http://127.0.0.1:${HTTP_PORT}/health"; echo; }
# The serving version's short fingerprint, from /health ("" while none serves).
serving() {
    curl -s "http://127.0.0.1:${HTTP_PORT}/health" | python -c \
        'import json, sys; print(json.load(sys.stdin).get("fingerprint", ""))' 2>/dev/null
}

python -m jaxpd.launch --role router --model "$OLD" --port "${ROUTER_PORT}" \
    --internal_port "${INTERNAL_PORT}" --http_port "${HTTP_PORT}" --host 127.0.0.1 \
    --max_model_len "${MAX_MODEL_LEN}" & pids+=($!)
python -m jaxpd.launch --role prefill --mesh prefill=2 --model "$OLD" "${COMMON[@]}" &
old_prefill=$!
python -m jaxpd.launch --role decode --mesh decode=2 --model "$OLD" "${COMMON[@]}" &
old_decode=$!
pids+=("$old_prefill" "$old_decode")
echo "v1 starting; send load now, e.g.:"
echo "  while :; do python -m jaxpd.client 'The list type' --target 127.0.0.1:${ROUTER_PORT}; done"
read -r -p "press Enter to start v2 ... "
v1=$(serving)
python -m jaxpd.launch --role prefill --mesh prefill=2 --model "$NEW" "${COMMON[@]}" &
pids+=($!)
python -m jaxpd.launch --role decode --mesh decode=2 --model "$NEW" "${COMMON[@]}" &
pids+=($!)
echo "v2 starting; v1 (model ${v1}) serves until v2 has both roles live"
until v2=$(serving) && [[ -n "$v2" && "$v2" != "$v1" ]]; do sleep 1; done
echo "new requests go to v2 (model ${v2})"; health
# New requests go to v2 from then on; a request already running on v1 finishes there.
# Give the longest of them time to end (max_tokens decode steps), then stop v1: a
# worker on SIGTERM takes no new call and lets those it holds finish within its grace.
sleep "${V1_DRAIN_S:-10}"
kill -TERM "$old_prefill" "$old_decode"
wait "$old_prefill" "$old_decode" || true
echo "v1 retired"; health
wait -n
