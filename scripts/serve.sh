#!/usr/bin/env bash
# `make serve`: builds the embedded tiny DeepSeek-V3.2 DSA model if absent and serves it.
# Usage: scripts/serve.sh MODEL KV_BACKEND HOST PORT [extra vllm serve args...]
set -euo pipefail
MODEL="$1"; KV_BACKEND="$2"; HOST="$3"; PORT="$4"; shift 4
VENV="${VENV:-.venv}"
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
if [ "$MODEL" = "models_cache/tiny-deepseek-v32" ] && [ ! -f "$MODEL/config.json" ]; then
  "$VENV/bin/python" -m ulacache_vllm.models build deepseek_v32 "$MODEL"
fi
unset VLLM_CPU_KVCACHE_SPACE  # an empty value crashes --kv-cache-memory-bytes on CPU
extra=()
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  # CPU build: a small explicit KV budget and float32 for the embedded tiny model.
  extra+=(--kv-cache-memory-bytes "${KV_CACHE_BYTES:-1073741824}" --max-model-len "${MAX_MODEL_LEN:-4096}")
fi
echo "[serve] vllm serve $MODEL --kv-backend $KV_BACKEND on http://$HOST:$PORT"
exec "$VENV/bin/vllm" serve "$MODEL" --host "$HOST" --port "$PORT" \
  --kv-backend "$KV_BACKEND" "${extra[@]}" "$@"
