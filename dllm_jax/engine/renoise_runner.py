"""The device side of Gemma4Renoise serving: the weights, the two KV pools and every row's denoising state.

Rows are slots (``max_rows`` of them); a running request holds one. The state of all slots stays on the device
between calls (``[C, H]`` self-conditioning per row, never logits); a call names the slots it starts and the
page tables, and gets back only what the host needs (which rows finished, their argmax canvases). A denoise call
computes only the first ``rows`` slots (a bucket holding the highest live slot; slots are handed out lowest free
first, so the live ones stay low): one request on a many-slot engine costs what it does alone.

* :meth:`encode` -- prompt chunks and finished canvases through the encoder into the pools (rows padded to a
  power of two, tokens to a power-of-two chunk; pads write to the trash page);
* :meth:`denoise` -- denoising steps on the device (a ``while_loop``) until the first live row finishes its canvas
  (FDFO) or all do (sync), at most ``max_steps``.

Shape buckets (:meth:`buckets`; compiled by :meth:`warmup`, every dimension a power of two; with a vision tower
also the tower over one image): a denoise call is ``CanvasKey(rows, width)`` (the first ``rows`` slots: 1, 2, 4,
... up to ``max_rows``; the page tables ``width`` pages wide); an encode call ``EncodeKey(rows, chunk, width)``.
Warm-up compiles every denoise rows x width, encodes of one row at every chunk its prefix can follow (a prompt
or its chunks), and encodes of 2, 4, ... rows of one canvas each (finished canvases, encoded together). Any other
encode shape (several prompts at once) compiles on the compiler's background thread while the scheduler encodes
the requests one at a time (:meth:`encode_key`, :class:`~dllm_jax.engine.compilation.Compiler`).

Tensor / expert parallel (``mesh``): the parameters split by the parameter table's logical axes
(:mod:`dllm_jax.sharding`: attention by head, MLPs by their intermediate dimension, experts over ``expert``, the
embedding -- which is also the tied LM head -- by vocabulary), each layer's pool by its own KV heads when they
divide, the row state replicated (it is small: ``[C, H]`` per row). The vocabulary pass runs per vocabulary shard
and merges the shards' partials (:func:`dllm_jax.decode.renoise.vocab_parallel_stats`). Several processes
(``channel``): the leader sends every call's padded inputs (a header ``[kind, rows, width, extra]``, then the
arrays, as the mask runner does) before running it; each follower's :meth:`follow` runs the same call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.decode import renoise, renoise_tables
from dllm_jax.decode.rows import MAX_TOP_LOGPROBS
from dllm_jax.engine.calls import Pending
from dllm_jax.engine.compilation import Compiler, pick_bucket, pow2_buckets
from dllm_jax.model import gemma
from dllm_jax.model import vision as vision_model
from pallas_kernels import next_pow2


@dataclasses.dataclass
class EncodeCall:
    """Encode ``tokens[i]`` of request ``reqs[i]`` at positions ``starts[i]...`` (its page tables ``tables``)."""

    reqs: list
    tokens: list[list[int]]
    starts: list[int]
    tables: dict  # kind -> [rows, width] int32 page ids
    # per row, the images whose tokens are in its chunk: (image, offset in the chunk, first soft token, count)
    images: list | None = None


@dataclasses.dataclass
class DenoiseCall:
    reqs: list  # the live rows' requests (for failures)
    start_slots: list[int]  # slots whose canvas starts now
    seeds: np.ndarray  # [rows] uint32, per slot (rows: RenoiseRunner.denoise_rows, the call's first slots)
    canvas_index: np.ndarray  # [rows] int32
    prefix_len: np.ndarray  # [rows] int32
    tables: dict  # kind -> [rows, width]
    live: np.ndarray  # [rows] bool: slots with a request decoding
    max_steps: int
    adjust: dict | None = None  # the penalty variant: renoise_tables.FIELDS -> [rows, width] (neutral rows empty)
    top: bool = False  # the top-k variant: record the MAX_TOP_LOGPROBS most likely tokens of each step


@dataclasses.dataclass
class DenoiseResult:
    finished: np.ndarray  # [max_rows] bool (slots past the call's rows: not touched by it)
    argmax: np.ndarray  # [max_rows, C] int32
    logprob: np.ndarray  # [R, C] float32
    steps: np.ndarray  # [rows] int32: steps each row ran in this call
    entropy: np.ndarray  # [R] float32
    top_logprob: np.ndarray | None = None  # [R, C, MAX_TOP_LOGPROBS] float32 (the top-k variant)
    top_ids: np.ndarray | None = None  # [R, C, MAX_TOP_LOGPROBS] int32


MIN_CHUNK = 16  # the smallest encode chunk (tokens per row)
KIND_STOP, KIND_ENCODE, KIND_DENOISE = 0, 1, 2  # header kinds (0 stops the followers, as the mask runner's)
VARIANT_PENALTIES, VARIANT_TOP = 4, 8  # bits of a denoise header's kind
_ADJUST_DTYPES = (np.int32, np.float32, np.float32, np.int32)  # renoise_tables.FIELDS


class EncodeKey(NamedTuple):
    kind: str  # "encode"
    rows: int
    chunk: int
    width: int


class VisionKey(NamedTuple):
    kind: str  # "vision": the tower over ``images`` images (a power of two)
    images: int


class CanvasKey(NamedTuple):
    kind: str  # "canvas"
    rows: int  # the first ``rows`` slots (RenoiseRunner.denoise_rows)
    width: int
    penalties: bool = False  # the variant with adjustment tables (renoise_tables.table_width(width * page_size))
    top: bool = False  # the variant recording the top MAX_TOP_LOGPROBS tokens


class RenoiseRunner:
    def __init__(self, params, cfg: ModelConfig, rcfg: renoise.RenoiseConfig, *, num_pages: dict, page_size: int,
                 max_rows: int, max_pages_per_row: int, max_chunk: int, first_finish: bool = True,
                 backend: str = "xla", dtype=jnp.float32, vision=None, vision_patches: int = 0, mesh=None,
                 channel=None):
        self.params, self.cfg, self.rcfg = params, cfg, rcfg
        self.vision = vision  # (tower params, VisionConfig) of a checkpoint served with images, else None
        self.vision_patches = vision_patches  # patches per image (the image processor's budget)
        self.mesh, self.channel = mesh, channel  # channel: multi-process, how the leader's calls reach followers
        self.device_calls = 0
        self.page_size, self.max_rows, self.dtype = page_size, max_rows, jnp.dtype(dtype)
        self.first_finish = first_finish
        self.widths = pow2_buckets(max_pages_per_row)
        self.chunks = tuple(c for c in pow2_buckets(max(MIN_CHUNK, max_chunk)) if c >= MIN_CHUNK)
        self.rows = pow2_buckets(max_rows)
        self.slot_rows = tuple(sorted({min(r, max_rows) for r in self.rows}))  # denoise rows (the state's slots)
        self.compiler = Compiler(self._lower, background=channel is None)
        self.num_pages = dict(num_pages)
        self.table_kinds = tuple(sorted(self.num_pages))  # the page tables' order on the wire
        new_pool = functools.partial(gemma.init_kv_pages, cfg, self.num_pages, page_size, self.dtype)
        zeros = jnp.zeros((max_rows,), jnp.uint32)
        state = renoise.initial_state(cfg, rcfg, zeros, zeros.astype(jnp.int32), self.dtype)._replace(
            finished=jnp.ones((max_rows,), bool))
        encode_kw, denoise_kw = {}, {}
        # fresh pool and state (also after a failed call took the donated ones with it: pool_lost)
        self._fresh_pool = new_pool
        self._fresh_state = lambda: jax.tree.map(lambda a: jnp.array(a, copy=True), state)  # own buffers
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            from dllm_jax.sharding import layer_pool_shardings, shard_params

            self.params = shard_params(params, cfg, mesh)
            pool_shardings = layer_pool_shardings(jax.eval_shape(new_pool), mesh)
            self._fresh_pool = jax.jit(new_pool, out_shardings=pool_shardings)  # each device allocates its shard
            replicated = NamedSharding(mesh, PartitionSpec())
            copy = self._fresh_state
            self._fresh_state = lambda: jax.device_put(copy(), replicated)
            # fixed output shardings: the donated pool and state come back as they went in (no re-layout, no
            # recompile), and every process can read the replicated results
            encode_kw, denoise_kw = dict(out_shardings=pool_shardings), dict(out_shardings=replicated)
        self.pool, self.state = self._fresh_pool(), self._fresh_state()  # own buffers: both are donated
        self.calls = {"encode": 0, "denoise": 0, "steps": 0}
        self._encode = jax.jit(functools.partial(gemma.encode_chunk, cfg=cfg), donate_argnames="kv_pages",
                               **encode_kw)
        if vision is not None:  # (the tower runs on one device; its features join the mesh replicated)
            self._vision = jax.jit(functools.partial(vision_model.image_features, vcfg=vision[1]))
        self._denoise = jax.jit(functools.partial(_denoise_loop, cfg=cfg, rcfg=rcfg, backend=backend, mesh=mesh),
                                donate_argnames="state", static_argnames=("first_finish", "top_k"), **denoise_kw)

    # -- shapes -----------------------------------------------------------------------------------
    def encode_key(self, rows: int, longest: int, width: int) -> EncodeKey:
        return EncodeKey("encode", next_pow2(rows), max(MIN_CHUNK, next_pow2(longest)), next_pow2(width))

    def canvas_key(self, width: int, penalties: bool = False, top: bool = False, rows: int | None = None) -> CanvasKey:
        return CanvasKey("canvas", self.denoise_rows(rows or self.max_rows), next_pow2(width), penalties, top)

    def denoise_rows(self, slots: int) -> int:
        """The rows a denoise call computes when its highest live slot is ``slots - 1``."""
        return pick_bucket(max(1, slots), self.slot_rows)

    def adjust_width(self, width: int) -> int:
        """The adjustment tables' width for page tables ``width`` pages wide (every real token of a row fits)."""
        return renoise_tables.table_width(next_pow2(width) * self.page_size)

    def buckets(self, *, penalties: bool = False, logprobs: bool = False, sampling: bool = False, **_) -> list:
        """The keys warm-up compiles (the module's doc): with ``penalties`` / ``logprobs`` also the denoise
        variants for such requests (every combination: a call may mix them); ``sampling`` does not apply (the
        renoise schedule always samples)."""
        canvas_chunk = max(MIN_CHUNK, next_pow2(self.cfg.block_size))
        variants = [(False, False)] + ([(True, False)] if penalties else [])
        variants += [(p, True) for p, _ in variants] if logprobs else []
        keys = [CanvasKey("canvas", r, w, p, t) for p, t in variants for r in self.slot_rows for w in self.widths]
        keys += [EncodeKey("encode", 1, c, w) for c in self.chunks for w in self.widths if 2 * w * self.page_size >= c]
        keys += [EncodeKey("encode", r, canvas_chunk, w) for r in self.rows[1:] for w in self.widths]
        if self.vision is not None:  # the tower for one image (more at once, and encodes with images: on first use)
            keys.append(VisionKey("vision", 1))
        return keys

    def num_buckets(self, background: bool = False, **variants) -> int:
        return len(self.buckets(**variants))

    def warmup(self, *, on_bucket=None, background: bool = False, **variants) -> int:
        """Compile every bucket now (``background`` is accepted and ignored: no staged warm-up for canvases); with
        followers, run each bucket's padding call instead (every process compiles it now, in step, not inside a
        later collective)."""
        run = self._run_padding if self.channel is not None else None
        return self.compiler.warmup(self.buckets(**variants), run=run, on_key=on_bucket)

    def _run_padding(self, key) -> None:
        """A call of bucket ``key`` that changes nothing: encode rows of no real token (they write to the trash
        page), or a denoise call with no live slot (every slot held as it is)."""
        if key.kind == "encode":
            header = [KIND_ENCODE, key.rows, key.width, key.chunk]
        else:
            adjust = self.adjust_width(key.width) if key.penalties else 0
            kind = KIND_DENOISE | (VARIANT_PENALTIES if key.penalties else 0) | (VARIANT_TOP if key.top else 0)
            header = [kind, key.rows, key.width, adjust]
        header = np.asarray(header, np.int32)
        self._execute(header, self._template(header))
        self.compiler.ran(key)

    def _lower(self, key):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
        if key.kind == "vision":
            vcfg = self.vision[1]
            pixels = jax.ShapeDtypeStruct((key.images, self.vision_patches, 3 * vcfg.patch_size ** 2), np.float32)
            return self._vision.lower(self.vision[0], pixels, i32(key.images, self.vision_patches, 2))
        if key.kind == "encode":
            tables = {k: i32(key.rows, key.width) for k in self.num_pages}
            return self._encode.lower(self.params, tokens=i32(key.rows, key.chunk), prefix_len=i32(key.rows),
                                      num_tokens=i32(key.rows), kv_pages=self.pool, page_tables=tables)
        R = key.rows
        flags = jax.ShapeDtypeStruct((R,), np.bool_)
        adjust = None
        if key.penalties:
            W = self.adjust_width(key.width)
            f32 = jax.ShapeDtypeStruct((R, W), np.float32)
            adjust = renoise.Adjust(i32(R, W), f32, f32, i32(R, W))
        return self._denoise.lower(self.params, self.state, flags, flags, jax.ShapeDtypeStruct((R,), np.uint32),
                                   i32(R), i32(R), self.pool, {k: i32(R, key.width) for k in self.num_pages}, i32(),
                                   adjust, first_finish=self.first_finish, top_k=MAX_TOP_LOGPROBS if key.top else 0)

    def stop_followers(self) -> None:
        if self.channel is not None:
            self.channel.send(np.asarray([KIND_STOP, 0, 0, 0], np.int32), {})

    def follow(self) -> int:
        """Follower loop (every process but the leader): run each call the leader sends until it stops. Returns
        the number of calls run."""
        calls = 0
        while True:
            header, arrays = self.channel.recv(self._template)
            if int(header[0]) == KIND_STOP:
                return calls
            channel, self.channel = self.channel, None
            try:
                self._execute(np.asarray(header), arrays)
                jax.block_until_ready(self.state if int(header[0]) & 3 == KIND_DENOISE else self.pool)
            finally:
                self.channel = channel
            calls += 1

    def _template(self, header) -> dict[str, np.ndarray]:
        """Zero arrays shaped like a call's inputs (the wire format; every array int32: seeds as their bits,
        flags as 0 / 1, the adjustment tables' floats as their bits)."""
        kind, rows, width, extra = (int(x) for x in header)
        i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        tables = {f"table_{k}": i32(rows, width) for k in self.table_kinds}
        if kind == KIND_ENCODE:
            return {"tokens": i32(rows, extra), "prefix_len": i32(rows), "num_tokens": i32(rows), **tables}
        out = {"start": i32(rows), "live": i32(rows), "seeds": i32(rows), "canvas_index": i32(rows),
               "prefix_len": i32(rows), "max_steps": i32(1), **tables}
        if kind & VARIANT_PENALTIES:
            out.update({f"adjust_{f}": i32(rows, extra) for f in renoise_tables.FIELDS})
        return out

    def _execute(self, header: np.ndarray, arrays: dict[str, np.ndarray]):
        """Run one call from its wire form (the leader sends it to the followers first). Returns the denoise
        call's per-row step counts (a device array), or None for an encode."""
        if self.channel is not None:
            self.channel.send(header, arrays)
        kind = int(header[0])
        tables = {k: arrays[f"table_{k}"] for k in self.table_kinds}
        self.device_calls += 1
        if kind == KIND_ENCODE:
            self.pool = self._encode(self.params, tokens=arrays["tokens"], prefix_len=arrays["prefix_len"],
                                     num_tokens=arrays["num_tokens"], kv_pages=self.pool, page_tables=tables)
            return None
        adjust = None
        if kind & VARIANT_PENALTIES:
            adjust = renoise.Adjust(*(arrays[f"adjust_{f}"].view(dt)
                                      for f, dt in zip(renoise_tables.FIELDS, _ADJUST_DTYPES)))
        self.state, steps = self._denoise(
            self.params, self.state, arrays["start"].astype(bool), arrays["live"].astype(bool),
            arrays["seeds"].view(np.uint32), arrays["canvas_index"], arrays["prefix_len"], self.pool, tables,
            arrays["max_steps"][0], adjust, first_finish=self.first_finish,
            top_k=MAX_TOP_LOGPROBS if kind & VARIANT_TOP else 0)
        return steps

    def pool_lost(self) -> bool:
        """After a device call raised: whether it took the donated KV pool (an encode) or per-slot state (a
        denoise call) with it. Then fresh ones replace them, so the engine serves on; every running request's K/V
        or canvas is gone (the scheduler fails them and empties the prefix index)."""
        pool = any(a.is_deleted() for a in jax.tree.leaves(self.pool))
        state = any(a.is_deleted() for a in jax.tree.leaves(self.state))
        if pool:
            self.pool = self._fresh_pool()
        if state:
            self.state = self._fresh_state()
        return pool or state

    def run(self, call):
        return self.collect(self.dispatch(call))

    def dispatch(self, call) -> Pending:
        """Start one planned call on the device and return at once: an encode (its result is nothing), or a
        denoise call, whose rows' results :meth:`collect` reads."""
        if isinstance(call, EncodeCall):
            with jax.profiler.TraceAnnotation("prefill"):
                self.encode(call)
            return Pending(None)
        with jax.profiler.TraceAnnotation("denoise_step"):
            steps = self._dispatch_denoise(call)
        return Pending(functools.partial(self._collect_denoise, steps))

    @staticmethod
    def collect(pending: Pending):
        return pending.collect() if pending.collect is not None else None

    def encode(self, call: EncodeCall) -> None:
        width = next(iter(call.tables.values())).shape[1]
        key = self.encode_key(len(call.reqs), max(len(t) for t in call.tokens), width)
        rows, chunk = key.rows, key.chunk
        tokens = np.zeros((rows, chunk), np.int32)
        counts = np.zeros(rows, np.int32)
        starts = np.zeros(rows, np.int32)
        for i, (toks, start) in enumerate(zip(call.tokens, call.starts)):
            tokens[i, :len(toks)], counts[i], starts[i] = toks, len(toks), start
        tables = {k: _pad(v, rows, key.width) for k, v in call.tables.items()}
        if call.images and any(call.images):
            # (an encode with images compiles its own executables, per image-count bucket; a text encode passes no
            # images argument at all: the executables warm-up lowered. Never sent to followers: a multi-process
            # engine loads no vision tower, dllm_jax/engine/families.py)
            images = self._image_inputs(call, rows, chunk)
            self.pool = self._encode(self.params, tokens=tokens, prefix_len=starts, num_tokens=counts,
                                     kv_pages=self.pool, page_tables=tables, images=images)
            self.device_calls += 1
        else:
            self._execute(np.asarray([KIND_ENCODE, rows, key.width, chunk], np.int32),
                          {"tokens": tokens, "prefix_len": starts, "num_tokens": counts,
                           **{f"table_{k}": v for k, v in tables.items()}})
            self.compiler.ran(key)
        self.calls["encode"] += 1

    def _image_inputs(self, call: EncodeCall, rows: int, chunk: int):
        """The tower's soft tokens for the call's images (one tower call) and where each goes: ``encode_chunk``'s
        ``images`` argument."""
        vparams, vcfg = self.vision
        pixels, positions, slots = vision_model.tower_batch([e[0] for row in call.images for e in row or ()])
        features = self._vision(vparams, jnp.asarray(pixels), jnp.asarray(positions))  # [N, L, H]
        self.compiler.ran(VisionKey("vision", len(pixels)))
        index, group = vision_model.placement(rows, chunk, features.shape[1], call.images, slots,
                                              vcfg.bidirectional)
        out = features.reshape(-1, features.shape[-1]), jnp.asarray(index), jnp.asarray(group)
        if self.mesh is not None:  # the tower ran on one device: its results join the mesh, replicated
            from jax.sharding import NamedSharding, PartitionSpec

            out = jax.device_put(out, NamedSharding(self.mesh, PartitionSpec()))
        return out

    def denoise(self, call: DenoiseCall) -> DenoiseResult:
        return self._collect_denoise(self._dispatch_denoise(call))

    def _dispatch_denoise(self, call: DenoiseCall):
        R = len(call.live)  # the call's first slots (RenoiseRunner.denoise_rows)
        start = np.zeros(R, np.int32)
        start[call.start_slots] = 1
        key = self.canvas_key(next(iter(call.tables.values())).shape[1], call.adjust is not None, call.top, R)
        assert key.rows == R, f"a denoise call of {R} rows (not a bucket: {self.slot_rows})"
        arrays = {"start": start, "live": np.asarray(call.live, np.int32),
                  "seeds": np.asarray(call.seeds, np.uint32).view(np.int32),
                  "canvas_index": np.asarray(call.canvas_index, np.int32),
                  "prefix_len": np.asarray(call.prefix_len, np.int32),
                  "max_steps": np.asarray([call.max_steps], np.int32),
                  **{f"table_{k}": _pad(v, R, key.width) for k, v in call.tables.items()}}
        width = 0
        if call.adjust is not None:
            for f, dt in zip(renoise_tables.FIELDS, _ADJUST_DTYPES):
                arrays[f"adjust_{f}"] = np.ascontiguousarray(call.adjust[f], dt).view(np.int32)
            width = arrays[f"adjust_{renoise_tables.FIELDS[0]}"].shape[1]
        kind = KIND_DENOISE | (VARIANT_PENALTIES if call.adjust is not None else 0) | (VARIANT_TOP if call.top else 0)
        steps = self._execute(np.asarray([kind, R, key.width, width], np.int32), arrays)
        self.compiler.ran(key)
        return steps, call.top

    def _collect_denoise(self, pending) -> DenoiseResult:
        steps, top = pending
        s = self.state
        tops = (s.top_logprob, s.top_ids) if top else ()
        fields = (s.finished, s.argmax, s.logprob, steps, s.entropy, *tops)
        # one transfer; with several processes each reads its own replica (device_get reads whole arrays)
        finished, argmax, logprob, steps, entropy, *tops = (
            jax.device_get(fields) if self.channel is None else [np.asarray(x) for x in fields])
        top_lp, top_ids = tops if top else (None, None)
        self.calls["denoise"] += 1
        self.calls["steps"] += int(steps.max(initial=0))
        return DenoiseResult(np.asarray(finished), np.asarray(argmax), np.asarray(logprob), np.asarray(steps),
                             np.asarray(entropy), top_lp, top_ids)


def _pad(table: np.ndarray, rows: int, width: int) -> np.ndarray:
    """A page table padded to ``[rows, width]`` (padding: page 0, the trash page)."""
    out = np.zeros((rows, width), np.int32)
    out[:table.shape[0], :table.shape[1]] = table
    return out


def _denoise_loop(params, state, start, live, seeds, canvas_index, prefix_len, kv_pages, page_tables, max_steps,
                  adjust=None, *, cfg, rcfg, backend, first_finish, top_k=0, mesh=None):
    """Start the canvases of ``start`` slots, then run steps until a live row finishes (``first_finish``) or all
    live rows have, at most ``max_steps``. Slots not ``live`` are held finished (they do not change). ``adjust`` /
    ``top_k``: the penalty and top-k variants (:func:`dllm_jax.decode.renoise.denoise_step`).

    The per-slot inputs cover the first ``rows`` slots (their length, static): only those are computed, the rest
    of the (donated) state is written back as it was. A row's arithmetic does not depend on ``rows``."""
    rows = live.shape[0]
    whole = state
    state = jax.tree.map(lambda a: a[:rows], whole)
    fresh = renoise.initial_state(cfg, rcfg, seeds, canvas_index, state.soft.dtype)
    pick = lambda a, b: jnp.where(start.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
    state = jax.tree.map(pick, fresh, state)
    state = state._replace(finished=jnp.where(live, state.finished, True))
    was = state.finished

    def cond(carry):
        st, i, _ = carry
        newly = st.finished & ~was
        stop = jnp.any(newly) if first_finish else jnp.all(st.finished)
        return (i < max_steps) & ~stop & ~jnp.all(st.finished)

    def body(carry):
        st, i, steps = carry
        steps = steps + (~st.finished).astype(jnp.int32)
        st = renoise.denoise_step(params, cfg, rcfg, st, seeds, canvas_index, prefix_len, kv_pages, page_tables,
                                  backend=backend, adjust=adjust, top_k=top_k, mesh=mesh)
        return st, i + 1, steps

    state, _, steps = jax.lax.while_loop(cond, body, (state, jnp.int32(0), jnp.zeros_like(prefix_len)))
    return jax.tree.map(lambda a, b: a.at[:rows].set(b), whole, state), steps
