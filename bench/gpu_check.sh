#!/usr/bin/env bash
# bench/gpu_check.sh -- every GPU measurement of the benchmark suite in one call, under 9 minutes.
#
#   bash bench/gpu_check.sh            # on a GPU machine (its preinstalled python3 + jax; no torch, no fastapi needed)
#   bash bench/gpu_check.sh --smoke    # anywhere: tiny shapes, checks that the script itself works
#
# 1. the card and the software (nvidia-smi, jax devices);
# 2. python -m bench.roofline: SDAR-1.7B-shape denoise steps (batch 1, 8, 64 x prefix 1k, 4k; Pallas and XLA
#    backends) beside their memory / compute floors, the card's measured copy and matmul ceilings, the engine
#    runner's host overhead per step (batch 1 and 64), the scheduler's host overhead with 32 requests in flight,
#    and the two GPU targets (batch-1 step <= 1.5x the memory floor, batch-64 step <= 2x the compute floor). It
#    stops starting new cases after ROOFLINE_BUDGET_S seconds and rewrites its JSON after every case;
# 3. python -m bench.kernels: the Pallas kernels vs XLA at the same shapes; python -m bench.renoise_gpu: one
#    Gemma4Renoise step at the DiffusionGemma-26B-A4B shape (6 layers) beside its memory and compute floors;
# 4. the engine end to end on the GPU: the README demo (shipped model, Pallas backends), then
#    python -m bench efficiency (issue 16): wall vs the bare forwards of the same calls, shipped model and the
#    random 50M model, 1 / 16 / 64 concurrent, FDFO and sync (each model under its own time limit).
#
# Logs and JSON go to bench_out/gpu/, or as one archive $OUT/gpu_check.tgz when $OUT is set (the lent machine). The last lines
# printed are the roofline table and the targets.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=""
[[ "${1:-}" == "--smoke" ]] && SMOKE="--smoke"
DEST="bench_out/gpu"
[[ -n "${OUT:-}" ]] && DEST="$(mktemp -d)"  # the lent machine returns 8 files at most: one archive goes to $OUT
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=2
PY="${PYTHON:-python3}"
ROOFLINE_BUDGET_S="${ROOFLINE_BUDGET_S:-150}"
T0=$(date +%s)

{
  echo "== machine =="
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv 2>/dev/null || echo "(no nvidia-smi)"
  "$PY" -c "import sys, jax, numpy; print('python', sys.version.split()[0], '| jax', jax.__version__, '| numpy', numpy.__version__); print(jax.devices())"
} 2>&1 | tee "$DEST/env.txt"

echo "== roofline (budget ${ROOFLINE_BUDGET_S} s) =="
timeout $(( ROOFLINE_BUDGET_S + 90 )) "$PY" -m bench.roofline $SMOKE --budget-s "$ROOFLINE_BUDGET_S" --out "$DEST/roofline.json" 2>&1 \
  | tee "$DEST/roofline.log"
echo "roofline exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"

echo "== kernels =="
timeout "${KERNELS_TIMEOUT_S:-110}" "$PY" -m bench.kernels $SMOKE --out "$DEST/kernels.json" 2>&1 | tee "$DEST/kernels.log"
echo "kernels exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"

echo "== DiffusionGemma-26B-A4B-shaped renoise step (6 layers, bf16 random weights) =="
timeout "${RENOISE_TIMEOUT_S:-120}" "$PY" -m bench.renoise_gpu $SMOKE --out "$DEST/renoise_gpu.json" 2>&1 | tee "$DEST/renoise_gpu.log"
echo "renoise exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"

echo "== engine: the README demo on the GPU =="
timeout 60 "$PY" -c "import sys; from dllm_jax.cli import main; sys.exit(main())" generate "Count up 11 steps from 71." 2>&1 | tee "$DEST/demo.log"
echo "demo exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"

if [[ -z "$SMOKE" ]]; then EFF_ARGS=(--efficiency-concurrency 1,16,64); EFF_MODELS=(shipped random50m)
else EFF_ARGS=(--quick --efficiency-concurrency 1,4 --max-new-tokens 16); EFF_MODELS=(shipped); fi
for model in "${EFF_MODELS[@]}"; do
  echo "== efficiency ($model) =="
  timeout "${EFFICIENCY_TIMEOUT_S:-100}" "$PY" -m bench efficiency --models "$model" --efficiency-models "$model" \
    "${EFF_ARGS[@]}" --out "$DEST/efficiency_$model" 2>&1 | tee "$DEST/efficiency_$model.log"
  echo "efficiency $model exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
done

echo "== summary =="
"$PY" - "$DEST/roofline.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:  # the roofline run died: its log above says why
    print(f"no roofline result: {e}")
    sys.exit(0)
from bench.roofline import format_rows
rows = [x for x in r["rows"] if "error" not in x]
if r.get("ceilings"):
    c = r["ceilings"]
    print(f"ceilings measured: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {c['matmul_flops'] / 1e12:.0f} TFLOP/s")
for o in r.get("runner_overhead", []):
    print(f"runner.denoise batch {o['batch']}: call {o['call_ms']:.3f} ms, device wait {o['device_wait_ms']:.3f} ms, "
          f"host {o['host_ms']:.3f} ms ({100 * o['host_frac']:.1f}%)")
s = r.get("scheduler_overhead")
if s:
    print(f"scheduler, {s['requests']} requests of {s['prompt_tokens']} tokens + {s['max_new_tokens']} new: host "
          f"{100 * s['host_frac']:.1f}% of all rounds; decode rounds {s['decode_round_ms']:.2f} ms with host "
          f"{100 * s['decode_host_frac']:.1f}% ({s['decode_host_ms_per_round']:.3f} ms)")
if not r.get("complete", True):
    print("(the roofline run was cut short: the figures above are what it had measured)")
for x in r["rows"]:
    if "error" in x:
        print(f"FAILED {x['backend']} batch {x['batch']} prefix {x['prefix']}: {x['error'][:200]}")
if r.get("skipped"):
    print(f"skipped (time budget): {r['skipped']}")
if rows:
    print(format_rows(rows))
for t in r.get("targets", []):
    v = "-" if t["value"] is None else f"{t['value']:.2f}x"
    res = "MET" if t["met"] else ("not met" if t["met"] is not None else "not measured")
    print(f"TARGET {t['name']}: {v} (<= {t['target']}x) {res}")
EOF
echo "total $(( $(date +%s) - T0 )) s; files in $DEST"
[[ -n "${OUT:-}" ]] && tar czf "$OUT/gpu_check.tgz" --exclude=models -C "$DEST" . && echo "archive: \$OUT/gpu_check.tgz"
