#!/usr/bin/env bash
# Streamed chat and completions with plain curl: `-N` turns off curl's buffering, so each
# server-sent event (`data: {...}`) prints the moment it arrives; the stream ends with `data: [DONE]`.
#
#   treadle serve &
#   examples/curl.sh                                  # http://127.0.0.1:8000
#   examples/curl.sh --base-url http://host:8000      # or: BASE_URL=http://host:8000 examples/curl.sh
#   examples/curl.sh "Write a haiku about looms."     # your own question
#
# Set OPENAI_API_KEY when the server was started with --api-key; MAX_TOKENS caps each reply (64).
set -euo pipefail

BASE_URL="${BASE_URL:-http://127.0.0.1:8000}"
MAX_TOKENS="${MAX_TOKENS:-64}"
PROMPT="Explain in two sentences what a treadle does."
while [[ $# -gt 0 ]]; do
  case "$1" in
    --base-url) BASE_URL="$2"; shift 2 ;;
    --base-url=*) BASE_URL="${1#*=}"; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) PROMPT="$1"; shift ;;
  esac
done
BASE_URL="${BASE_URL%/}"
AUTH=()
if [[ -n "${OPENAI_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${OPENAI_API_KEY}"); fi
# The prompt goes into JSON: escape backslashes and double quotes.
ESCAPED="${PROMPT//\\/\\\\}"
ESCAPED="${ESCAPED//\"/\\\"}"

echo "# chat: POST $BASE_URL/v1/chat/completions"
curl -sS -N --fail-with-body "$BASE_URL/v1/chat/completions" "${AUTH[@]}" \
  -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "system", "content": "You are a concise, helpful assistant."},
                    {"role": "user", "content": "'"$ESCAPED"'"}],
       "max_tokens": '"$MAX_TOKENS"', "stream": true, "stream_options": {"include_usage": true}}'

echo "# completions: POST $BASE_URL/v1/completions"
curl -sS -N --fail-with-body "$BASE_URL/v1/completions" "${AUTH[@]}" \
  -H 'Content-Type: application/json' \
  -d '{"prompt": "'"$ESCAPED"'", "max_tokens": '"$MAX_TOKENS"', "stream": true}'
