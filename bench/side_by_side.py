"""The engine beside transformers' SDAR block-diffusion loop on one GPU: ``python -m bench.side_by_side [--smoke]``.

Both stacks load one random checkpoint in the published SDAR layout at the SDAR-1.7B shape (28 layers, hidden 2048,
16 / 8 heads of 128, MLP 6144, vocab 151,936, tied; bf16; written by
:func:`dllm_jax.testing.published.write_published`, block size 32) and decode the same prompts (random token ids,
all of one length) with greedy LowConfidence (threshold 0.95), ``ignore_eos``, the same number of new tokens:

* **ours**: :class:`dllm_jax.Engine` (bf16, the Pallas kernels, FDFO, the GPU defaults), driven by
  ``bench.common.run_requests`` with 1 and 16 requests in flight; a first pass compiles what the pass uses and is
  thrown away;
* **transformers**: ``Qwen3ForCausalLM`` in bf16 with SDPA on the same GPU, driven by
  :class:`bench.hf_baseline.HFBlockDiffusion`: one prompt at a time at batch 1, :meth:`generate_batch` over the 16
  prompts at batch 16 (one forward per step for the batch); a warm-up generate first.

Random weights put every position's top probability far below the threshold, so both stacks unmask one position
per step (32 denoise forwards per block) and do the same work. Reported per batch: output tokens/s of each, the
ratio, forwards per block, and how many answers are token-identical (bf16 on two stacks: near-ties may differ).
Target (issue 39): ours >= 3x the transformers loop's tokens/s at batch 16.

``--smoke``: a tiny random checkpoint on any machine (CPU: float32, the engine's XLA path), to check the script.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time

TARGET_B16 = 3.0


def _checkpoint(path: str, smoke: bool, block: int) -> float:
    from dllm_jax.testing import published

    t0 = time.perf_counter()
    dims = None if smoke else dict(published.SDAR_1P7B_SHAPE)
    published.write_published(path, "sdar", dims=dims, block_size=block, std=0.02, embed_std=0.02,
                              max_shard_bytes=1 << 30, remote_code_traps=False)
    return time.perf_counter() - t0


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(10, 300, length)] for _ in range(n)]  # plain BPE ids, no specials


def run_ours(path: str, prompts, batches, max_new: int, *, block: int, smoke: bool, log=print) -> dict:
    import jax

    from bench.common import run_requests
    from dllm_jax import Engine

    longest = max(len(p) for p in prompts) + max_new + 2 * block
    pages = -(-longest // block)
    rows = max(batches)
    prompt_blocks = max(1, max(len(p) for p in prompts) // block)
    kw = dict(dtype="float32" if smoke else "bfloat16", max_running_requests=rows, context_length=pages * block,
              num_kv_pages=rows * pages + 8, enable_prefix_cache=False, algorithm_config={"threshold": 0.95},
              block_size=block, progress=False,
              # few executables (each compiles in ~10 s at this shape): 2 rows (one request and its folded-commit
              # row), the larger batches with and without their folded-commit rows (x2); one page-table width; the
              # whole prompt prefilled in one call, of one row or of the largest batch
              shape_buckets=dict(rows=tuple(sorted({2, *(b for b in batches if b > 1), *(2 * b for b in batches)})),
                                 pages=(pages,), prefill_rows=tuple(sorted({1, rows})),
                                 prefill_blocks=(prompt_blocks,)))
    t0 = time.perf_counter()
    engine = Engine(path, **kw)
    load_s = time.perf_counter() - t0
    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}
    out = dict(load_s=load_s, backend=dict(attention=engine.attention_backend, confidence=engine.confidence_backend,
                                           device=jax.devices()[0].device_kind), runs={})
    try:
        for b in batches:
            ps = prompts[:max(b, 2 if b == 1 else b)]
            t0 = time.perf_counter()
            run_requests(engine, ps, params, b)  # compiles what this batch uses
            warm_s = time.perf_counter() - t0
            r = run_requests(engine, ps, params, b)
            out["runs"][str(b)] = dict(tokens_per_s=r["tokens_per_s"], wall_s=r["wall_s"], warm_s=warm_s,
                                       output_tokens=r["output_tokens"], forward_passes=r["forward_passes"],
                                       forwards_per_request=r["forward_passes"] / max(r["requests"], 1),
                                       device_calls=r["device_calls"], recompiles=r["recompiles"],
                                       host_overhead_frac=r["host_overhead_frac"], outputs=r["outputs"])
            log(f"  ours, {b:2d} in flight: {r['tokens_per_s']:9.1f} tok/s ({r['output_tokens']} tokens in "
                f"{r['wall_s']:.2f} s; first pass {warm_s:.1f} s with compiles; {r['recompiles']} recompiles)")
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    return out


def run_transformers(path: str, prompts, batches, max_new: int, *, smoke: bool, log=print) -> dict:
    import torch

    from bench.hf_baseline import HFBlockDiffusion

    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    t0 = time.perf_counter()
    hf = HFBlockDiffusion(path, dtype="float32" if smoke else "bfloat16", threshold=0.95,
                          attn_implementation="sdpa", device=device)
    out = dict(load_s=time.perf_counter() - t0, device=device, torch=torch.__version__, runs={})
    import transformers

    out["transformers"] = transformers.__version__
    hf.generate(prompts[0], min(max_new, hf.block_size), ignore_eos=True)  # warm-up (CUDA context, cuBLAS)
    try:
        for b in batches:
            if b == 1:
                ps = prompts[:2]
                t0 = time.perf_counter()
                f0 = hf.forwards
                outs = [hf.generate(p, max_new, ignore_eos=True)["output_ids"] for p in ps]
                wall = time.perf_counter() - t0
                forwards = hf.forwards - f0
            else:
                ps = prompts[:b]
                hf.generate_batch(ps, hf.block_size, ignore_eos=True)  # warm-up at this batch
                res = hf.generate_batch(ps, max_new, ignore_eos=True)
                outs, wall, forwards = res["outputs"], res["latency"], res["forward_passes"]
            tokens = sum(len(o) for o in outs)
            out["runs"][str(b)] = dict(tokens_per_s=tokens / wall, wall_s=wall, output_tokens=tokens,
                                       forward_passes=forwards, outputs=outs,
                                       # every request of a batch takes part in each of the batch's forwards
                                       forwards_per_request=forwards / len(ps) if b == 1 else forwards)
            log(f"  transformers, batch {b:2d}: {tokens / wall:9.1f} tok/s ({tokens} tokens in {wall:.2f} s, "
                f"{forwards} forwards)")
    finally:
        del hf
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    from bench.common import GpuScript, identical_fraction

    cli = GpuScript("side_by_side", __doc__, what="comparison", batches=[1, 16],
                    smoke_help="tiny random checkpoint, any machine (checks the script)")
    ap = cli.parser
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default=None, help="where to write the checkpoint (default: a temporary dir)")
    args = cli.parse(argv)
    # The two stacks share the GPU: JAX must not take 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    if cli.no_gpu(args.smoke):
        return 0
    block = 4 if args.smoke else 32
    prompt_tokens = 8 if args.smoke else args.prompt_tokens
    max_new = 8 if args.smoke else args.max_new_tokens
    batches = [min(b, 4) for b in args.batches] if args.smoke else args.batches
    root = args.model_dir or tempfile.mkdtemp(prefix="dllm-side-by-side-")
    path = os.path.join(root, "sdar-1.7b-random" if not args.smoke else "sdar-tiny-random")
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, smoke=args.smoke, block=block,
                  prompt_tokens=prompt_tokens, max_new_tokens=max_new, batches=batches)
    try:
        if not os.path.isfile(os.path.join(path, "config.json")):
            result["checkpoint_write_s"] = _checkpoint(path, args.smoke, block)
            print(f"side_by_side: wrote the checkpoint in {result['checkpoint_write_s']:.1f} s ({path})")
        prompts = _prompts(max(batches + [2]), prompt_tokens)
        print(f"side_by_side: {len(prompts)} prompts of {prompt_tokens} tokens, {max_new} new tokens each, B = {block}")
        result["ours"] = run_ours(path, prompts, batches, max_new, block=block, smoke=args.smoke)
        cli.write(result)  # kept if the transformers half is cut short
        try:
            result["transformers"] = run_transformers(path, prompts, batches, max_new, smoke=args.smoke)
        except ImportError as e:
            result["transformers"] = dict(error=f"{type(e).__name__}: {e}")
            print(f"side_by_side: no transformers loop ({e})")
    finally:
        if args.model_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = []
    for b in batches:
        o = result["ours"]["runs"].get(str(b))
        h = result.get("transformers", {}).get("runs", {}).get(str(b))
        if not o or not h:
            continue
        k = min(len(o["outputs"]), len(h["outputs"]))
        same, agree = identical_fraction(o["outputs"][:k], h["outputs"][:k])
        rows.append(dict(batch=b, ours_tokens_per_s=o["tokens_per_s"], hf_tokens_per_s=h["tokens_per_s"],
                         speedup=o["tokens_per_s"] / h["tokens_per_s"], identical_answers=same,
                         token_agreement=agree, ours_forwards=o["forwards_per_request"],
                         hf_forwards=h["forwards_per_request"]))
    result["rows"] = rows
    b16 = next((r for r in rows if r["batch"] == max(batches)), None)
    result["target"] = dict(name=f"ours / transformers tokens/s at batch {max(batches)}", target=TARGET_B16,
                            value=b16["speedup"] if b16 else None,
                            met=None if b16 is None or args.smoke else b16["speedup"] >= TARGET_B16)
    cli.write(result)
    print("side by side (same checkpoint, prompts and tokens; greedy, ignore_eos):")
    print(f"  {'batch':>5}  {'ours tok/s':>10}  {'transformers tok/s':>18}  {'speedup':>7}  {'identical':>9}  "
          f"{'tokens agree':>12}  {'forwards / request: ours, hf':>28}")
    for r in rows:
        print(f"  {r['batch']:5d}  {r['ours_tokens_per_s']:10.1f}  {r['hf_tokens_per_s']:18.1f}  {r['speedup']:6.2f}x  "
              f"{r['identical_answers']:9.0%}  {r['token_agreement']:12.1%}  "
              f"{r['ours_forwards']:>13.1f}, {r['hf_forwards']:<13.1f}")
    t = result["target"]
    verdict = "MET" if t["met"] else ("not met" if t["met"] is not None else "not judged (smoke)")
    value = "-" if t["value"] is None else f"{t['value']:.2f}x"
    print(f"TARGET {t['name']}: {value} (>= {TARGET_B16}x) {verdict}")
    return cli.wrote()


if __name__ == "__main__":
    sys.exit(main())
