#!/usr/bin/env bash
# bench/gpu_check.sh -- the GPU measurements of issue 39 in one call, under 8 minutes on an H100 or H200.
#
#   bash bench/gpu_check.sh                   # on a GPU machine (its preinstalled python3: jax, torch, transformers)
#   bash bench/gpu_check.sh --smoke           # anywhere: tiny shapes, interpret mode (checks the script itself)
#   bash bench/gpu_check.sh --pack-before [REV]  # here, before the GPU call: bench_out/before_tree.tgz (see 3)
#
# Stages (each under `timeout`, each given what is left of GPU_CHECK_DEADLINE_S, default 470 s; a stage that would
# get less than it needs is skipped and said so), most needed first:
# 1. the card and the software (nvidia-smi, jax, torch);
# 2. python -m bench.roofline (this tree, "after"): SDAR-1.7B-shape denoise steps (the target cases first: Pallas,
#    batch 1 and 64, prefix 1k; more while ROOFLINE_BUDGET_S lasts) beside their floors, at the datasheet and at the
#    card's measured copy / matmul ceilings; the runner's host overhead per call and how much of it is hidden
#    behind the device (issue 39 item 6), the scheduler with 32 requests of 1k tokens in flight;
# 3. python -m bench.step_profile: a profiler trace of the batch-1 and batch-64 steps read back: the top ops with
#    their device time and share of the step, each op class against its own roofline (item 1);
# 4. python -m bench.kernels: attention and confidence in device time (loops on the device), the confidence
#    crossover grid written into pallas_kernels/confidence_crossover.json (and a copy in the output), then the
#    attention sweep (split counts x key tiles) (items 1-3);
# 5. python -m bench.side_by_side: the engine vs transformers' SDAR loop in bf16 with SDPA on the same random
#    1.7B-shape checkpoint, batch 1 and 16 (item 7); python -m bench.host_overlap: the engine serving streamed
#    requests with host_overlap off and on, host time per call hidden vs exposed (item 6);
# 6. the same roofline from the previous commit ("before"; Pallas, batch 1 and 64, 1k): a `git archive` of it when
#    this copy has .git (REV: $BEFORE_REV, else HEAD when the tree has uncommitted changes, else HEAD~1), else
#    bench_out/before_tree.tgz (`--pack-before` writes it here; carry it to the GPU machine), else $BEFORE_TREE (a
#    directory or .tgz);
# 7. data parallel, on a machine with 2+ GPUs and sglang-router installed (else skipped at once, saying why):
#    python -m bench.dp --workers <GPUs>: one replica on one GPU vs one per GPU behind SGLang's router (`dllm-jax
#    serve --dp N`), and the router's added latency per request (issue 48);
# 8. DiffusionGemma (issue 46): python -m bench.renoise_gpu --check: the fused vocabulary pass's Pallas kernel
#    compiled for real (plain, penalty-table and top-k variants) and the streaming XLA loop against the
#    materialised reference at the published vocabulary / hidden / canvas in bf16 (decisions equal wherever the
#    reference separates them, statistics within 1e-3); then python -m bench.renoise_gpu: one denoising step of
#    the 26B-A4B shape cut to 6 layers, 1 and 8 canvases over a 4k prefix, Pallas vs XLA, beside its floors;
# then a summary: the before / after roofline table and every target.
# GPU_CHECK_ONLY=<text>: only the stages whose name holds it (GPU_CHECK_ONLY=DiffusionGemma: stage 8 alone). GPU_CHECK_EXTRA=1 adds the older
# stages after these (the README demo, the efficiency runs); they do not fit in the 8 minutes with the rest.
#
# Logs and JSON go to bench_out/gpu/, or as one archive $OUT/gpu_check.tgz when $OUT is set (the lent machine returns
# at most 8 files), with the crossover table beside it ($OUT/confidence_crossover.json). The last lines printed are
# the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
SMOKE=""
if [[ "${1:-}" == "--pack-before" ]]; then
  rev="${2:-}"
  if [[ -z "$rev" ]]; then
    if git diff --quiet HEAD -- 2>/dev/null; then rev="HEAD~1"; else rev="HEAD"; fi
  fi
  mkdir -p bench_out
  git archive --format=tar.gz -o bench_out/before_tree.tgz "$rev" && \
    echo "bench_out/before_tree.tgz: $(git rev-parse --short "$rev") ($(du -h bench_out/before_tree.tgz | cut -f1));" \
         "carry it: run(..., carry=[\"bench_out/before_tree.tgz\"])"
  exit $?
fi
[[ "${1:-}" == "--smoke" ]] && SMOKE="--smoke"
DEST="bench_out/gpu"
[[ -n "${OUT:-}" ]] && DEST="$(mktemp -d)"  # the lent machine returns 8 files at most: one archive goes to $OUT
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=2
# compiled executables on disk: a second run on a warm machine skips the compiles (the engine uses this directory)
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/dllm-jax/xla}"
PY="${PYTHON:-python3}"
DEADLINE_S="${GPU_CHECK_DEADLINE_S:-470}"
T0=$(date +%s)
SKIPPED=()

left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
# stage_timeout WANT NEED: WANT seconds, or what is left (minus 15 s for the summary); 0 when less than NEED is left
stage_timeout() {
  local want=$1 need=$2 rest
  rest=$(( $(left) - 15 ))
  (( rest < need )) && { echo 0; return; }
  (( rest < want )) && want=$rest
  echo "$want"
}
run_stage() {  # run_stage NAME WANT NEED LOG cmd...
  local name=$1 want=$2 need=$3 log=$4 t
  shift 4
  if [[ -n "${GPU_CHECK_ONLY:-}" && "$name" != *"$GPU_CHECK_ONLY"* ]]; then
    echo "== $name: not run (GPU_CHECK_ONLY=$GPU_CHECK_ONLY) =="
    return
  fi
  t=$(stage_timeout "$want" "$need")
  if [[ -z "$SMOKE" && "$t" == 0 ]]; then
    echo "== $name: SKIPPED (only $(left) s left of ${DEADLINE_S} s) =="
    SKIPPED+=("$name")
    return
  fi
  [[ -n "$SMOKE" ]] && t=$want
  echo "== $name (timeout ${t} s) =="
  timeout "$t" "$@" 2>&1 | tee "$log"
  echo "$name exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
}

{
  echo "== machine =="
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv 2>/dev/null || echo "(no nvidia-smi)"
  "$PY" -c "import sys, jax, numpy; print('python', sys.version.split()[0], '| jax', jax.__version__, '| numpy', numpy.__version__); print(jax.devices())"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())" 2>/dev/null \
    || echo "(no torch / transformers: the side-by-side stage will say so)"
  git -C "$REPO" log -1 --format='tree: %h %s' 2>/dev/null || echo "tree: (no .git in this copy)"
} 2>&1 | tee "$DEST/env.txt"

# 2. after
if [[ -n "$SMOKE" ]]; then ROOF_ARGS=(--smoke); else
  ROOF_ARGS=(--budget-s "${ROOFLINE_BUDGET_S:-35}" --overhead-budget-s "${OVERHEAD_BUDGET_S:-55}"); fi
run_stage "roofline (this tree)" "${ROOFLINE_TIMEOUT_S:-120}" 60 "$DEST/roofline.log" \
  "$PY" -m bench.roofline "${ROOF_ARGS[@]}" --out "$DEST/roofline.json"

# 3. step profile
if [[ -n "$SMOKE" ]]; then SP_ARGS=(--smoke); else SP_ARGS=(--batches 1 64 --prefix 1024); fi
run_stage "step profile" "${PROFILE_TIMEOUT_S:-75}" 45 "$DEST/step_profile.log" \
  "$PY" -m bench.step_profile "${SP_ARGS[@]}" --trace-dir "$DEST/traces" --out "$DEST/step_profile.json"

# 4. kernels: device time, attention sweep, confidence crossover (the table `auto` reads is rewritten in place)
if [[ -n "$SMOKE" ]]; then
  K_ARGS=(--smoke --sweep --write-crossover "$DEST/confidence_crossover.smoke.json")
else
  K_ARGS=(--sweep --sweep-budget-s "${SWEEP_BUDGET_S:-25}" --budget-s "${KERNELS_BUDGET_S:-90}"
          --crossover-positions 32 128 512 2048 --write-crossover)
fi
run_stage "kernels" "${KERNELS_TIMEOUT_S:-105}" 50 "$DEST/kernels.log" \
  "$PY" -m bench.kernels "${K_ARGS[@]}" --out "$DEST/kernels.json"
[[ -z "$SMOKE" ]] && cp pallas_kernels/confidence_crossover.json "$DEST/confidence_crossover.json"

# 5. side by side with transformers
if [[ -n "$SMOKE" ]]; then SBS_ARGS=(--smoke); else SBS_ARGS=(--batches 1 16); fi
run_stage "side by side: engine vs transformers" "${SIDE_TIMEOUT_S:-150}" 80 "$DEST/side_by_side.log" \
  "$PY" -m bench.side_by_side "${SBS_ARGS[@]}" --out "$DEST/side_by_side.json"

# 5b. the engine's host work hidden behind the device, host_overlap off / on (item 6)
if [[ -n "$SMOKE" ]]; then HO_ARGS=(--requests 4 --concurrency 2 --max-new-tokens 16 --repeats 1); else
  HO_ARGS=(--requests 48 --concurrency 16 --max-new-tokens 64 --repeats 2); fi
run_stage "host overlap (engine, shipped model)" "${OVERLAP_TIMEOUT_S:-60}" 30 "$DEST/host_overlap.log" \
  "$PY" -m bench.host_overlap "${HO_ARGS[@]}" --out "$DEST/host_overlap.json"

# 6. before
BEFORE=""
prepare_before() {
  local dir src rev
  dir="$(mktemp -d)"
  src="${BEFORE_TREE:-}"
  [[ -z "$src" && -f "$REPO/bench_out/before_tree.tgz" ]] && src="$REPO/bench_out/before_tree.tgz"
  if [[ -n "$src" && -d "$src" ]]; then BEFORE="$src"; echo "before: the tree in $src"; return 0; fi
  if [[ -n "$src" ]]; then
    tar -xzf "$src" -C "$dir" && BEFORE="$dir" && echo "before: $src" && return 0
  elif git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
    rev="${BEFORE_REV:-}"
    if [[ -z "$rev" ]]; then
      if git -C "$REPO" diff --quiet HEAD -- 2>/dev/null; then rev="HEAD~1"; else rev="HEAD"; fi
    fi
    git -C "$REPO" archive "$rev" | tar -x -C "$dir" && BEFORE="$dir" && \
      echo "before: git archive $(git -C "$REPO" rev-parse --short "$rev")" && return 0
  fi
  echo "before: no previous tree here (no .git in this copy, no bench_out/before_tree.tgz: run"
  echo "        'bash bench/gpu_check.sh --pack-before' where the repository is, and carry bench_out/before_tree.tgz)"
  return 1
}
if [[ -n "${GPU_CHECK_ONLY:-}" && "roofline (previous commit)" != *"$GPU_CHECK_ONLY"* ]]; then
  echo "== roofline (previous commit): not run (GPU_CHECK_ONLY=$GPU_CHECK_ONLY) =="
elif prepare_before; then
  if [[ -n "$SMOKE" ]]; then BARGS=(--smoke); else
    BARGS=(--batches 1 64 --prefixes 1024 --backends pallas --no-runner-check --no-scheduler-check --budget-s 40); fi
  run_stage "roofline (previous commit)" "${BEFORE_TIMEOUT_S:-70}" 40 "$DEST/roofline_before.log" \
    env PYTHONPATH="$BEFORE" bash -c 'cd "$0" && exec "$@"' "$BEFORE" \
    "$PY" -m bench.roofline "${BARGS[@]}" --out "$DEST/roofline_before.json"
else
  SKIPPED+=("roofline (previous commit): no previous tree")
fi

# 7. data parallel: one replica vs one per GPU behind SGLang's router
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NGPU=${DP_GPUS:-${NGPU:-0}}
if (( NGPU < 2 )); then
  echo "== data parallel: SKIPPED (${NGPU} GPU(s): it needs 2 or more) =="
  SKIPPED+=("data parallel: ${NGPU} GPU(s), needs 2+")
elif ! "$PY" -c "import sglang_router" 2>/dev/null; then
  echo "== data parallel: SKIPPED (no sglang_router in $PY: pip install 'dllm-jax[router]', or carry its wheel) =="
  SKIPPED+=("data parallel: no sglang_router")
else
  if [[ -n "$SMOKE" ]]; then DP_ARGS=(--smoke); else
    DP_ARGS=(--requests "${DP_REQUESTS:-2000}" --concurrency "${DP_CONCURRENCY:-128}" --max-running-requests 64); fi
  run_stage "data parallel (${NGPU} GPUs)" "${DP_TIMEOUT_S:-240}" 120 "$DEST/dp.log" \
    "$PY" -m bench.dp --workers "$NGPU" "${DP_ARGS[@]}" --out "$DEST/dp.json"
fi

# 8. DiffusionGemma: the renoise kernel vs its references, then the step at the published shape
run_stage "DiffusionGemma kernels vs references" "${RENOISE_CHECK_TIMEOUT_S:-120}" 45 "$DEST/renoise_kernels.log" \
  "$PY" -m bench.renoise_gpu --check $SMOKE --out "$DEST/renoise_kernels.json"
run_stage "DiffusionGemma renoise step" "${RENOISE_TIMEOUT_S:-150}" 60 "$DEST/renoise_gpu.log" \
  "$PY" -m bench.renoise_gpu $SMOKE --out "$DEST/renoise_gpu.json"

if [[ "${GPU_CHECK_EXTRA:-0}" == "1" ]]; then
  run_stage "engine: the README demo" 60 30 "$DEST/demo.log" \
    "$PY" -c "import sys; from dllm_jax.cli import main; sys.exit(main())" generate "Count up 11 steps from 71."
  if [[ -z "$SMOKE" ]]; then EFF_ARGS=(--efficiency-concurrency 1,16,64); EFF_MODELS=(shipped random50m)
  else EFF_ARGS=(--quick --efficiency-concurrency 1,4 --max-new-tokens 16); EFF_MODELS=(shipped); fi
  for model in "${EFF_MODELS[@]}"; do
    run_stage "efficiency ($model)" "${EFFICIENCY_TIMEOUT_S:-100}" 60 "$DEST/efficiency_$model.log" \
      "$PY" -m bench efficiency --models "$model" --efficiency-models "$model" "${EFF_ARGS[@]}" \
      --out "$DEST/efficiency_$model"
  done
fi

echo "== summary =="
"$PY" - "$DEST" "${SKIPPED[@]+"${SKIPPED[@]}"}" <<'EOF'
import json, os, sys

dest, skipped = sys.argv[1], sys.argv[2:]


def load(name):
    try:
        with open(os.path.join(dest, name)) as f:
            return json.load(f)
    except Exception as e:  # the stage died or was skipped: its log says why
        print(f"({name}: {type(e).__name__})")
        return None


from bench.roofline import at_measured_ceilings, format_overlap, format_rows, judge

overlap = load("host_overlap.json")
for mode in ("off", "on") if overlap else ():
    b = overlap[mode]["best"]
    print(f"engine host_overlap {mode}: {b['tokens_per_s']:.0f} tok/s, per denoise call exposed host "
          f"{b['exposed_ms']:.3f} ms, hidden {b['hidden_ms']:.3f} ms, device wait {b['wait_ms']:.3f} ms; same tokens "
          f"as off: {overlap[mode]['identical_to_off']}")

after, before = load("roofline.json"), load("roofline_before.json")
ceil = (after or {}).get("ceilings") or {}
if ceil:
    print(f"ceilings measured: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil['matmul_flops'] / 1e12:.0f} TFLOP/s")
if after:
    for o in after.get("runner_overhead", []):
        print(f"runner.denoise batch {o['batch']}: call {o['call_ms']:.3f} ms, device wait {o['device_wait_ms']:.3f} "
              f"ms, host {o['host_ms']:.3f} ms ({100 * o['host_frac']:.1f}%)")
        for mode, ov in (o.get("overlap_modes") or {"": o.get("overlap")}).items():
            if ov:
                print("  " + format_overlap(f"back to back {mode}", ov))
    s = after.get("scheduler_overhead")
    if s:
        print(f"scheduler, {s['requests']} requests of {s['prompt_tokens']} tokens + {s['max_new_tokens']} new: host "
              f"{100 * s['host_frac']:.1f}% of all rounds; decode rounds {s['decode_round_ms']:.2f} ms with host "
              f"{100 * s['decode_host_frac']:.1f}%")
        if s.get("overlap"):
            print("  " + format_overlap("scheduler", s["overlap"]))
    for x in after["rows"]:
        if "error" in x:
            print(f"FAILED {x['backend']} batch {x['batch']} prefix {x['prefix']}: {x['error'][:200]}")
    if not after.get("complete", True):
        print("(the roofline run was cut short: the figures are what it had measured)")

prof = load("step_profile.json")
if prof:
    from bench.step_profile import CLASS_LABELS
    for p in prof.get("profiles", []):
        if "classes" not in p:
            print(f"step profile batch {p.get('batch')}: {p.get('error') or 'no op events'}")
            continue
        top = ", ".join(f"{o['hlo_op']} ({o['cls']}) {o['us_per_step']:.0f} us {100 * o['share']:.0f}%"
                        for o in p["ops"][:5])
        print(f"step profile batch {p['batch']}: {p['pipelined_ms']:.3f} ms back to back, device ops "
              f"{p['busy_us_per_step'] / 1e3:.3f} ms; top: {top}")
        for c in p["classes"]:
            if c["us_per_step"] > 0:
                print(f"    {CLASS_LABELS[c['cls']]:24s} {c['us_per_step']:9.1f} us {100 * c['share']:5.1f}%  floor "
                      f"{c.get('floor_us', float('nan')):8.1f} us ({c.get('bound', '-')}) -> {c.get('x_floor', float('nan')):6.2f}x")

kern = load("kernels.json")
if kern:
    for sw in kern.get("sweep", []):
        if sw.get("best") and sw.get("default"):
            b, d = sw["best"], sw["default"]
            print(f"attention sweep batch {sw['rows']} prefix {sw['prefix']}: default {d['time_us']:.1f} us "
                  f"({100 * d.get('copy_frac', float('nan')):.0f}% of copy), best {b['time_us']:.1f} us "
                  f"({100 * b.get('copy_frac', float('nan')):.0f}%) with {b['tiles']}")
    for e in kern.get("crossover", []):
        print(f"confidence {e['positions']:5d} positions {'[V,H]' if e['vocab_major'] else '[H,V]'}: pallas "
              f"{e['pallas_us']:.1f} us, xla {e['xla_us']:.1f} us -> {e['winner']}")
    if kern.get("crossover_written"):
        print(f"crossover table written: {kern['crossover_written']}")

sbs = load("side_by_side.json")
if sbs:
    for r in sbs.get("rows", []):
        print(f"side by side batch {r['batch']}: ours {r['ours_tokens_per_s']:.1f} tok/s, transformers "
              f"{r['hf_tokens_per_s']:.1f} tok/s -> {r['speedup']:.2f}x (identical answers {r['identical_answers']:.0%})")

if after:
    rows = [x for x in after["rows"] if "error" not in x]
    if rows:
        print(format_rows(rows))
    if before:
        brows = {(x["backend"], x["batch"], x["prefix"]): at_measured_ceilings(x, ceil)
                 for x in before.get("rows", []) if "error" not in x}
        print("before / after (step ms, waited for; x floor at the measured ceilings where measured):")
        for r in rows:
            b = brows.get((r["backend"], r["batch"], r["prefix"]))
            if b:
                fk = "memory_floor_ms_measured" if r["batch"] == 1 else "compute_floor_ms_measured"
                fk = fk if fk in r else ("memory_floor_ms" if r["batch"] == 1 else "compute_floor_ms")
                print(f"  {r['backend']:6s} batch {r['batch']:3d} prefix {r['prefix']:5d}: {b['step_ms']:8.3f} -> "
                      f"{r['step_ms']:8.3f} ms ({b['step_ms'] / r['step_ms']:.2f}x faster); x {fk.split('_')[0]} "
                      f"floor {b['step_ms'] / r[fk]:.2f} -> {r['step_ms'] / r[fk]:.2f}")
    for t in after.get("targets", []):
        v = "-" if t["value"] is None else f"{t['value']:.2f}x"
        res = "MET" if t["met"] else ("not met" if t["met"] is not None else "not measured")
        print(f"TARGET {t['name']}: {v} (<= {t['target']}x) {res}")
if sbs and sbs.get("target"):
    t = sbs["target"]
    v = "-" if t["value"] is None else f"{t['value']:.2f}x"
    res = "MET" if t["met"] else ("not met" if t["met"] is not None else "not judged")
    print(f"TARGET {t['name']}: {v} (>= {t['target']}x) {res}")
rk = load("renoise_kernels.json")
for r in (rk or {}).get("results", []):
    what = r["error"][:200] if "error" in r else (f"differing where clear {r['differ_where_clear']}, rel err "
                                                  + ", ".join(f"{k} {v:.1e}" for k, v in r["rel_err"].items()))
    print(f"DiffusionGemma kernel {r['variant']} {r['impl']}: {what} -> {'PASS' if r['passed'] else 'FAIL'}")
rg = load("renoise_gpu.json")
for r in (rg or {}).get("rows", []):
    if "error" in r:
        print(f"DiffusionGemma step rows {r['rows']} {r['backend']}: {r['error'][:200]}")
    else:
        floor = f", wall/floor {r['wall_over_floor']:.2f}" if "wall_over_floor" in r else ""
        print(f"DiffusionGemma step rows {r['rows']} {r['backend']}: {r['step_ms']:.2f} ms ({r['layers']} layers, "
              f"prefix {r['prefix']}){floor}")
dp = load("dp.json") if os.path.exists(os.path.join(dest, "dp.json")) else None
if dp:
    from bench.dp import report

    print(report(dp))
for s in skipped:
    print(f"SKIPPED: {s}")
EOF
echo "total $(( $(date +%s) - T0 )) s; files in $DEST"
if [[ -n "${OUT:-}" ]]; then
  tar czf "$OUT/gpu_check.tgz" --exclude=models --exclude=traces -C "$DEST" . && echo "archive: \$OUT/gpu_check.tgz"
  [[ -f "$DEST/confidence_crossover.json" ]] && cp "$DEST/confidence_crossover.json" "$OUT/"
  # the raw traces (the step profile's xplane files) in their own archive, if it fits what comes back (16 MiB)
  if [[ -d "$DEST/traces" ]]; then
    (cd "$DEST" && find traces -name '*.xplane.pb' -print0 | tar czf "$OUT/step_traces.tgz" --null -T -)
    if (( $(stat -c %s "$OUT/step_traces.tgz") > 15 * 1024 * 1024 )); then
      rm -f "$OUT/step_traces.tgz"; echo "(step traces over 15 MiB: not returned)"
    else echo "archive: \$OUT/step_traces.tgz"; fi
  fi
fi
exit 0
