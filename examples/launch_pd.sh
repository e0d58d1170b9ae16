#!/usr/bin/env bash
# A split deployment from plain commands: what `pdserve launch` does, spelled out for users who
# run instances on different hosts. Each block can run on its own machine; set the *_HOST
# variables to addresses the other machines can reach (the side channel binds to them too).
#
#   MODEL=/path/to/model bash examples/launch_pd.sh        # all on this host
#   PREFILL_HOST=10.0.0.1 DECODE_HOST=10.0.0.2 ...          # per host: run only its block
set -euo pipefail

PDSERVE=${PDSERVE:-.venv/bin/pdserve}
MODEL_ARGS=${MODEL:+--model $MODEL}
EXTRA_ARGS=${EXTRA_ARGS:-}                 # e.g. "--dtype float32 --max-model-len 2048"
TRANSPORT=${TRANSPORT:-nixl}               # nixl or ucx
PREFILL_HOST=${PREFILL_HOST:-127.0.0.1}
PREFILL_PORT=${PREFILL_PORT:-8100}
PREFILL_SIDE_CHANNEL_PORT=${PREFILL_SIDE_CHANNEL_PORT:-5600}
DECODE_HOST=${DECODE_HOST:-127.0.0.1}
DECODE_PORT=${DECODE_PORT:-8200}
DECODE_SIDE_CHANNEL_PORT=${DECODE_SIDE_CHANNEL_PORT:-5601}
PROXY_HOST=${PROXY_HOST:-127.0.0.1}
PROXY_PORT=${PROXY_PORT:-8000}

kv_config() {  # $1 = kv_producer | kv_consumer
  echo "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"$1\", \"kv_connector_extra_config\": {\"transport\": \"$TRANSPORT\"}}"
}

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

# Prefill host: answers the proxy's first hop and serves its KV blocks over the side channel.
PDSERVE_SIDE_CHANNEL_HOST=$PREFILL_HOST PDSERVE_SIDE_CHANNEL_PORT=$PREFILL_SIDE_CHANNEL_PORT \
  $PDSERVE serve $MODEL_ARGS $EXTRA_ARGS --host "$PREFILL_HOST" --port "$PREFILL_PORT" \
  --kv-transfer-config "$(kv_config kv_producer)" &
pids+=($!)

# Decode host: reads the blocks named by each request's kv_transfer_params and generates.
PDSERVE_SIDE_CHANNEL_HOST=$DECODE_HOST PDSERVE_SIDE_CHANNEL_PORT=$DECODE_SIDE_CHANNEL_PORT \
  $PDSERVE serve $MODEL_ARGS $EXTRA_ARGS --host "$DECODE_HOST" --port "$DECODE_PORT" \
  --kv-transfer-config "$(kv_config kv_consumer)" &
pids+=($!)

for url in "http://$PREFILL_HOST:$PREFILL_PORT" "http://$DECODE_HOST:$DECODE_PORT"; do
  until curl -sf "$url/health" >/dev/null; do sleep 1; done
done

# Proxy (any host that reaches both): list more --prefill / --decode addresses to scale out.
$PDSERVE proxy --host "$PROXY_HOST" --port "$PROXY_PORT" \
  --prefill "$PREFILL_HOST:$PREFILL_PORT" --decode "$DECODE_HOST:$DECODE_PORT" &
pids+=($!)
until curl -sf "http://$PROXY_HOST:$PROXY_PORT/health" >/dev/null; do sleep 1; done
echo "serving http://$PROXY_HOST:$PROXY_PORT/v1 - Ctrl-C stops it"
wait
