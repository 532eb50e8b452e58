#!/usr/bin/env bash
# lm-eval's local-completions against `dllm-jax serve` on the shipped model: the multiple-choice task of this
# folder (loglikelihood requests: /v1/completions with echo + logprobs, token-id prompts). From the repo root:
#   LM_EVAL=/tmp/lmeval/bin/lm_eval bash bench/lm_eval_task/run.sh
# (lm-eval in its own venv: python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install lm_eval; the project venv
# active for dllm-jax.) PORT (default 30123), LIMIT (lm-eval --limit, default all 50 docs).
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-30123}
LM_EVAL=${LM_EVAL:-lm_eval}
MODEL_DIR=$(python -c "from dllm_jax.assets import DEFAULT_MODEL_PATH; print(DEFAULT_MODEL_PATH)")
LOG=$(mktemp -t dllm-serve-XXXX.log)

dllm-jax serve --host 127.0.0.1 --port "$PORT" --max-running-requests 4 --no-warmup >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 1
done

start=$(date +%s)
HF_DATASETS_OFFLINE=1 "$LM_EVAL" --model local-completions \
  --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=sdar-tiny,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1" \
  --tasks dllm_tiny_mc --include_path bench/lm_eval_task ${LIMIT:+--limit "$LIMIT"}
echo "lm_eval wall time: $(( $(date +%s) - start )) s"
