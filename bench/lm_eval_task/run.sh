#!/usr/bin/env bash
# lm-eval's local-completions against `dllm-jax serve` on the shipped model: the multiple-choice task of this
# folder (loglikelihood requests: /v1/completions with echo + logprobs, token-id prompts). From the repo root:
#   LM_EVAL=/tmp/lmeval/bin/lm_eval bash bench/lm_eval_task/run.sh
# (lm-eval in its own venv: python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install lm_eval; the project venv
# active for dllm-jax.) PORT (default: a free port), LIMIT (lm-eval --limit, default all 50 docs).
#
# The server it starts is the one lm-eval evaluates: it serves the model under an extra name made for this run
# (a random nonce), and lm-eval starts only once that name answers on the port (a server already listening there,
# or one of another run, does not know it). If the server cannot start (the port taken, a bad model), the script
# says so, shows the server's log and exits 1.
set -euo pipefail
cd "$(dirname "$0")/../.."
LM_EVAL=${LM_EVAL:-lm_eval}
PYTHON=${PYTHON:-python}
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
NONCE=run-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(8))')
MODEL_DIR=$("$PYTHON" -c "from dllm_jax.assets import DEFAULT_MODEL_PATH; print(DEFAULT_MODEL_PATH)")
BASE=http://127.0.0.1:$PORT
LOG=$(mktemp -t dllm-serve-XXXX.log)
SERVER=

fail() {
  echo "run.sh: $*" >&2
  if [ -s "$LOG" ]; then
    echo "run.sh: the server's log ($LOG), last lines:" >&2
    tail -n 20 "$LOG" >&2
  fi
  exit 1
}

stop_server() {  # (the EXIT trap: never fails, whatever state the server is in)
  if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
    kill "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
  fi
  return 0
}
trap 'status=$?; stop_server; exit $status' EXIT

dllm-jax serve --host 127.0.0.1 --port "$PORT" --max-running-requests 4 --no-warmup \
  --served-model-name "sdar-tiny,$NONCE" >"$LOG" 2>&1 &
SERVER=$!
ready=
for _ in $(seq 300); do
  kill -0 "$SERVER" 2>/dev/null || fail "the server exited before it was ready (port $PORT taken? set PORT to a free one)"
  # our server, and not another one on the port: only it lists the model under this run's name
  if curl -sf "$BASE/v1/models" 2>/dev/null | "$PYTHON" -c "import json, sys
sys.exit('$NONCE' not in [m.get('id') for m in json.load(sys.stdin).get('data', [])])" 2>/dev/null; then
    ready=1
    break
  fi
  sleep 1
done
[ -n "$ready" ] || fail "the server did not answer on $BASE within 300 s"
echo "run.sh: dllm-jax serve (pid $SERVER) ready on $BASE"

start=$(date +%s)
HF_DATASETS_OFFLINE=1 "$LM_EVAL" --model local-completions \
  --model_args "base_url=$BASE/v1/completions,model=sdar-tiny,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1" \
  --tasks dllm_tiny_mc --include_path bench/lm_eval_task ${LIMIT:+--limit "$LIMIT"}
echo "lm_eval wall time: $(( $(date +%s) - start )) s"
