"""A batch of DiffusionGemma requests decoded with Gemma4Renoise, start to end: the family's generation loop.

Rows are requests. The encoder encodes the prompts (padded to one chunk length, each row its own length) into a
paged pool, then canvas after canvas: fresh canvases from each row's counter stream, denoising steps on the
device until every live row has finished its canvas (one host check per step), the argmax canvases appended,
EOS looked for, and the canvases encoded into the pool. A row that has finished its request rides along until
the batch ends (its outputs are not changed).

A static batch, no scheduler: the reference the replay test drives against transformers' ``generate``
(``on_step`` sees every step's draws) and the engine's tests compare with; the engine runs the same device step
(:func:`dllm_jax.decode.renoise.denoise_step`) through :mod:`dllm_jax.engine.canvases`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.decode import renoise, renoise_tables
from dllm_jax.model import gemma, vision
from pallas_kernels import next_pow2

PAGE = 16  # tokens per KV page


@dataclasses.dataclass
class RowResult:
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length"
    forward_passes: int  # decoder forwards this row took part in while unfinished
    steps_per_canvas: list[int]
    logprobs: list[float]  # each output token's log-probability under its canvas's last step
    top: list = dataclasses.field(default_factory=list)  # with top_k: per output token [(logprob, id)] * top_k


class RenoiseLoop:
    def __init__(self, params, cfg: ModelConfig, rcfg: renoise.RenoiseConfig, *, backend: str = "xla",
                 dtype=jnp.float32, vision=None):
        self.params, self.cfg, self.rcfg, self.backend, self.dtype = params, cfg, rcfg, backend, jnp.dtype(dtype)
        self.vision = vision  # (tower params, VisionConfig): prompts with images
        self._encode = jax.jit(functools.partial(gemma.encode_chunk, cfg=cfg), donate_argnames="kv_pages")
        self._step = jax.jit(functools.partial(renoise.denoise_step, cfg=cfg, rcfg=rcfg, backend=backend),
                             static_argnames=("draws", "top_k"))
        self._init = jax.jit(functools.partial(renoise.initial_state, cfg, rcfg, dtype=self.dtype))

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], seeds: list[int], *,
                 eos_token_ids=(), ignore_eos: list[bool] | None = None, options: list[dict] | None = None,
                 top_k: int = 0, on_step: Callable | None = None, on_canvas: Callable | None = None,
                 images: list | None = None) -> list[RowResult]:
        """Decode every prompt. ``on_step(canvas_index, state, draws)`` after each step; ``on_canvas(row,
        tokens)`` when a row appends a canvas (streaming). ``options``: per row, the keyword arguments of
        :func:`dllm_jax.decode.renoise_tables.canvas_entries` other than history / prompt_len / canvas_len
        (penalties, biases, min_new with its stop ids; EOS ends a row at the first EOS id or ``stop_ids`` entry);
        ``top_k``: also each output token's ``top_k`` most likely tokens. ``images``: per row, the prompt's images
        as ``(image, first position, count)`` (:class:`dllm_jax.engine.images.PreparedImage`, its span of image
        tokens in the expanded prompt)."""
        cfg, canvas_len = self.cfg, self.cfg.block_size
        rows = len(prompts)
        ignore_eos = ignore_eos or [False] * rows
        canvases = max(-(-n // canvas_len) for n in max_new_tokens)
        longest = max(len(p) for p in prompts) + canvases * canvas_len
        width = next_pow2(-(-longest // PAGE))  # (shapes padded to powers of two: few compiles)
        tables = {kind: jnp.asarray(1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width))
                  for kind in (gemma.SLIDING_KIND, gemma.FULL_KIND)}
        num_pages = rows * width + 1
        pool = gemma.init_kv_pages(cfg, {gemma.SLIDING_KIND: num_pages, gemma.FULL_KIND: num_pages}, PAGE,
                                   self.dtype)
        chunk = max(16, next_pow2(max(len(p) for p in prompts)))
        tokens = np.zeros((rows, chunk), np.int32)
        for r, p in enumerate(prompts):
            tokens[r, :len(p)] = p
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        extra = {"images": self._images(images, rows, chunk)} if images and any(images) else {}
        pool = self._encode(self.params, tokens=jnp.asarray(tokens), prefix_len=jnp.zeros(rows, jnp.int32),
                            num_tokens=jnp.asarray(lengths), kv_pages=pool, page_tables=tables, **extra)
        seeds_dev = jnp.asarray(np.asarray(seeds, np.int64).astype(np.uint32))
        results = [RowResult([], "length", 0, [], []) for _ in range(rows)]
        done = np.zeros(rows, bool)
        for c in range(canvases):
            live = ~done
            state = self._init(seeds_dev, jnp.full((rows,), c, jnp.int32))
            state = state._replace(finished=jnp.asarray(done))  # finished requests ride along
            steps = np.zeros(rows, np.int32)
            adjust = None
            if options is not None:
                adj = renoise_tables.empty_tables(rows, renoise_tables.table_width(width * PAGE))
                for r, opts in enumerate(options):
                    renoise_tables.put_row(adj, r, renoise_tables.canvas_entries(
                        history=list(prompts[r]) + results[r].output_ids, prompt_len=len(prompts[r]),
                        canvas_len=canvas_len, **opts))
                adjust = renoise.Adjust(*(jnp.asarray(adj[f]) for f in renoise_tables.FIELDS))
            while True:
                was = np.asarray(state.finished)
                state, draws = self._step(self.params, state=state, seeds=seeds_dev,
                                          canvas_index=jnp.full((rows,), c, jnp.int32),
                                          prefix_len=jnp.asarray(lengths), kv_pages=pool, page_tables=tables,
                                          draws=True, adjust=adjust, top_k=top_k)
                steps += ~was
                if on_step is not None:
                    on_step(c, state, draws)
                if bool(np.all(np.asarray(state.finished))):
                    break
            argmax, logprob = np.asarray(state.argmax), np.asarray(state.logprob)
            for r in np.flatnonzero(live):
                res = results[r]
                res.forward_passes += int(steps[r])
                res.steps_per_canvas.append(int(steps[r]))
                take = min(canvas_len, max_new_tokens[r] - len(res.output_ids))
                new = argmax[r, :take].tolist()
                stops = (set() if ignore_eos[r] else set(eos_token_ids)) | set(
                    (options[r].get("stop_ids", ()) if options else ()))
                hit = next((i for i, t in enumerate(new) if t in stops), None)
                if hit is not None:
                    new, done[r], res.finish_reason = new[:hit + 1], True, "stop"
                res.output_ids += new
                res.logprobs += logprob[r, :len(new)].tolist()
                if top_k:
                    top_lp, top_ids = np.asarray(state.top_logprob), np.asarray(state.top_ids)
                    res.top += [list(zip(top_lp[r, i, :top_k].tolist(), top_ids[r, i, :top_k].tolist()))
                                for i in range(len(new))]
                if len(res.output_ids) >= max_new_tokens[r]:
                    done[r] = True
                if on_canvas is not None:
                    on_canvas(r, new)
            if done.all():
                break
            canvas_tokens = np.zeros((rows, max(16, next_pow2(canvas_len))), np.int32)
            canvas_tokens[:, :canvas_len] = argmax
            pool = self._encode(self.params, tokens=jnp.asarray(canvas_tokens), prefix_len=jnp.asarray(lengths),
                                num_tokens=jnp.full((rows,), canvas_len, jnp.int32), kv_pages=pool,
                                page_tables=tables)
            lengths = lengths + canvas_len
        return results

    def _images(self, images, rows: int, chunk: int):
        vparams, vcfg = self.vision
        entries = [[(img, first, 0, count) for img, first, count in row or ()] for row in images]
        pixels, positions, slots = vision.tower_batch([e[0] for row in entries for e in row])
        features = vision.image_features(vparams, jnp.asarray(pixels), jnp.asarray(positions), vcfg)
        index, group = vision.placement(rows, chunk, features.shape[1], entries, slots, vcfg.bidirectional)
        return features.reshape(-1, features.shape[-1]), jnp.asarray(index), jnp.asarray(group)
