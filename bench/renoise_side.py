"""One side of ``bench.renoise``'s comparison, in a process of its own (its peak RSS is its own): the engine or
transformers' ``generate`` serving ``--requests`` prompts on a DiffusionGemma checkpoint, warmed up, then timed.

    python -m bench.renoise_side --side engine|hf --model DIR --requests N [--slots S] [--steps 2] [--reps 2]

Prints one JSON line: the wall time of each timed repetition, the tokens and decoder forwards, and the memory:

* ``imports_rss``: resident bytes once the side's libraries are imported (the bare process);
* ``peak_rss``: the process's high-water mark over loading, compiling and serving (``VmHWM``; read before the
  reset below and at the end of the timed repetitions);
* ``serving_peak_rss``: the high-water mark of the timed repetitions alone (``VmHWM`` reset after the warm-up by
  writing 5 to ``/proc/self/clear_refs``; where that is refused, the whole-life mark).

The engine side also reports what its memory should be (``model``): the bytes of the weights, of both KV pools
(sized to the requests: ``num_kv_pages``), of the per-slot state between steps (``[canvas x hidden]`` plus a few
``[canvas]`` vectors per slot) and of the denoise executable's scratch (XLA's own ``memory_analysis``), and the
largest array of that executable with a vocabulary-sized and a canvas-sized dimension (``None``: none, the fused
pass keeps no ``[canvas x vocab]`` array).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

GIB = 1 << 30


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids (equal lengths: a transformers batch needs no padding)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab - 1, length).tolist() for _ in range(n)]


def write_model(path: str, *, vocab: int, canvas: int, hidden: int, layers: int, window: int, experts: int = 4,
                seed: int = 0) -> None:
    """A random DiffusionGemma checkpoint written by transformers (``dllm_jax.testing.diffusion_gemma``): the
    given vocabulary and canvas, a small decoder (layers alternate sliding / full, the last one full)."""
    from dllm_jax.testing.diffusion_gemma import write_tiny_diffusion_gemma

    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    heads = max(2, hidden // 16)
    write_tiny_diffusion_gemma(path, canvas_length=canvas, sliding_window=window, hidden_size=hidden,
                               intermediate_size=2 * hidden, vocab_size=vocab, num_hidden_layers=layers,
                               layer_types=types, num_experts=experts, num_attention_heads=heads,
                               num_key_value_heads=max(1, heads // 2), head_dim=16, global_head_dim=32,
                               moe_intermediate_size=hidden // 2, max_position_embeddings=4 * canvas + 1024,
                               seed=seed)


def _nbytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


_SHAPE = re.compile(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8)\[([0-9,]+)\]")


def vocab_arrays(hlo: str, vocab: int, canvas: int) -> list[str]:
    """Array shapes of an executable's HLO with a vocabulary-sized dimension next to a canvas-sized one (a
    multiple of ``canvas``): ``[canvas x vocab]`` arrays (the weights ``[V, H]`` are not: H is no such multiple
    in the bench's configurations)."""
    found = set()
    for m in _SHAPE.finditer(hlo):
        dims = [int(d) for d in m.group(1).split(",") if d]
        if vocab in dims and any(d != vocab and d % canvas == 0 for d in dims):
            found.add(m.group(0))
    return sorted(found)


def engine_side(a) -> dict:
    import jax

    import dllm_jax

    imports = _status("VmRSS")
    ps = prompts(a.requests, a.prompt_len, a.vocab)
    slots = a.slots or a.requests
    page = 16
    context = -(-(a.prompt_len + a.max_new) // page) * page
    pages = a.requests * (context // page) + 1  # what the requests use (+ the trash page)
    engine = dllm_jax.Engine(model_path=a.model, warmup=False, max_running_requests=slots, num_kv_pages=pages,
                             context_length=context, max_prefill_tokens=max(a.canvas, page),
                             compilation_cache="off", algorithm_config={"max_denoising_steps": a.steps})
    params = [{"max_new_tokens": a.max_new, "seed": i, "ignore_eos": True} for i in range(a.requests)]
    try:
        loaded = _status("VmRSS")
        engine.generate(input_ids=ps, sampling_params=params)  # compiles these shapes
        warm, before = _status("VmRSS"), _status("VmHWM")
        reset = _reset_peak()
        walls, outs = [], None
        for _ in range(a.reps):
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=ps, sampling_params=params)
            walls.append(time.perf_counter() - t0)
        serving_peak = _status("VmHWM")
        runner = engine.runner
        model = {"weights": _nbytes(runner.params), "kv_pools": _nbytes(runner.pool), "state": _nbytes(runner.state),
                 "kv_pages": {k: int(v) for k, v in runner.num_pages.items()}}
        width = max(1, context // page)
        compiled = runner._lower(runner.canvas_key(width)).compile()
        mem = compiled.memory_analysis()
        model["denoise_scratch"] = int(mem.temp_size_in_bytes) if mem is not None else 0
        canvas_vocab = vocab_arrays(compiled.as_text(), a.vocab, a.canvas)
    finally:
        engine.shutdown()
    return dict(side="engine", requests=a.requests, slots=slots, walls=walls,
                tokens=sum(len(o["output_ids"]) for o in outs),
                forwards=sum(o["meta_info"]["forward_passes"] for o in outs), imports_rss=imports,
                loaded_rss=loaded, warm_rss=warm, serving_peak_rss=serving_peak if reset else None,
                peak_rss=max(before, serving_peak), model=model, canvas_vocab_arrays=canvas_vocab,
                platform=jax.default_backend())


def hf_side(a) -> dict:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    imports = _status("VmRSS")
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    ps = prompts(a.requests, a.prompt_len, a.vocab)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(a.model, dtype=torch.float32).eval()
    loaded = _status("VmRSS")

    def run(batch, steps, count):
        """transformers' generate over the first ``count`` prompts, one call per request (``batch`` 1) or in
        batches."""
        tokens = forwards = 0
        for i in range(0, count, batch):
            torch.manual_seed(i)
            with torch.no_grad():
                res = model.generate(torch.tensor(ps[i:i + batch]), max_new_tokens=a.max_new,
                                     max_denoising_steps=steps)
            new = res.sequences.shape[1] - a.prompt_len
            tokens += new * res.sequences.shape[0]
            forwards += int(sum(new / float(t) for t in res.tokens_per_forward))  # its own count of passes
        return tokens, forwards

    run(a.hf_batch, 1, a.hf_batch)  # warm-up: one call of the same shapes, one step
    warm, before = _status("VmRSS"), _status("VmHWM")
    reset = _reset_peak()
    walls = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        tokens, forwards = run(a.hf_batch, a.steps, len(ps))
        walls.append(time.perf_counter() - t0)
    serving_peak = _status("VmHWM")
    return dict(side="hf", requests=a.requests, batch=a.hf_batch, walls=walls, tokens=tokens, forwards=forwards,
                imports_rss=imports, loaded_rss=loaded, warm_rss=warm,
                serving_peak_rss=serving_peak if reset else None, peak_rss=max(before, serving_peak),
                threads=torch.get_num_threads())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=("engine", "hf"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--slots", type=int, default=None, help="engine: max_running_requests (default: --requests)")
    p.add_argument("--hf-batch", type=int, default=1, help="transformers: prompts per generate call")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--canvas", type=int, required=True)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=None, help="default: one canvas")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    a.max_new = a.max_new or a.canvas
    out = engine_side(a) if a.side == "engine" else hf_side(a)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
