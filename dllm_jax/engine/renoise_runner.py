"""The device side of Gemma4Renoise serving: the weights, the two KV pools and every row's denoising state.

Rows are slots (``max_rows`` of them); a running request holds one. The state of all slots stays on the device
between calls (``[C, H]`` self-conditioning per row, never logits); a call names the slots it starts and the
page tables, and gets back only what the host needs (which rows finished, their argmax canvases).

* :meth:`encode` -- prompt chunks and finished canvases through the encoder into the pools (rows padded to a
  power of two, tokens to a power-of-two chunk; pads write to the trash page);
* :meth:`denoise` -- denoising steps on the device (a ``while_loop``) until the first live row finishes its canvas
  (FDFO) or all do (sync), at most ``max_steps``.

Shape buckets (:meth:`buckets`; compiled by :meth:`warmup`, every dimension a power of two): a denoise call is
``CanvasKey(width)`` (every slot, the page tables ``width`` pages wide); an encode call ``EncodeKey(rows, chunk,
width)``. Warm-up compiles every denoise width, encodes of one row at every chunk its prefix can follow (a prompt
or its chunks), and encodes of 2, 4, ... rows of one canvas each (finished canvases, encoded together). Any other
encode shape (several prompts at once) compiles on the compiler's background thread while the scheduler encodes
the requests one at a time (:meth:`encode_key`, :class:`~dllm_jax.engine.compilation.Compiler`).
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
from dllm_jax.engine.compilation import Compiler, pow2_buckets
from dllm_jax.model import gemma
from pallas_kernels import next_pow2


@dataclasses.dataclass
class EncodeCall:
    """Encode ``tokens[i]`` of request ``reqs[i]`` at positions ``starts[i]...`` (its page tables ``tables``)."""

    reqs: list
    tokens: list[list[int]]
    starts: list[int]
    tables: dict  # kind -> [rows, width] int32 page ids


@dataclasses.dataclass
class DenoiseCall:
    reqs: list  # the live rows' requests (for failures)
    start_slots: list[int]  # slots whose canvas starts now
    seeds: np.ndarray  # [max_rows] uint32, per slot
    canvas_index: np.ndarray  # [max_rows] int32
    prefix_len: np.ndarray  # [max_rows] int32
    tables: dict  # kind -> [max_rows, width]
    live: np.ndarray  # [max_rows] bool: slots with a request decoding
    max_steps: int
    adjust: dict | None = None  # the penalty variant: renoise_tables.FIELDS -> [max_rows, width] (neutral rows empty)
    top: bool = False  # the top-k variant: record the MAX_TOP_LOGPROBS most likely tokens of each step


@dataclasses.dataclass
class DenoiseResult:
    finished: np.ndarray  # [R] bool
    argmax: np.ndarray  # [R, C] int32
    logprob: np.ndarray  # [R, C] float32
    steps: np.ndarray  # [R] int32: steps each row ran in this call
    entropy: np.ndarray  # [R] float32
    top_logprob: np.ndarray | None = None  # [R, C, MAX_TOP_LOGPROBS] float32 (the top-k variant)
    top_ids: np.ndarray | None = None  # [R, C, MAX_TOP_LOGPROBS] int32


MIN_CHUNK = 16  # the smallest encode chunk (tokens per row)


class EncodeKey(NamedTuple):
    kind: str  # "encode"
    rows: int
    chunk: int
    width: int


class CanvasKey(NamedTuple):
    kind: str  # "canvas"
    width: int
    penalties: bool = False  # the variant with adjustment tables (renoise_tables.table_width(width * page_size))
    top: bool = False  # the variant recording the top MAX_TOP_LOGPROBS tokens


class RenoiseRunner:
    channel = None  # single process (multi-process serving of this family is not built)

    def __init__(self, params, cfg: ModelConfig, rcfg: renoise.RenoiseConfig, *, num_pages: dict, page_size: int,
                 max_rows: int, max_pages_per_row: int, max_chunk: int, first_finish: bool = True,
                 backend: str = "xla", dtype=jnp.float32):
        self.params, self.cfg, self.rcfg = params, cfg, rcfg
        self.page_size, self.max_rows, self.dtype = page_size, max_rows, jnp.dtype(dtype)
        self.first_finish = first_finish
        self.widths = pow2_buckets(max_pages_per_row)
        self.chunks = tuple(c for c in pow2_buckets(max(MIN_CHUNK, max_chunk)) if c >= MIN_CHUNK)
        self.rows = pow2_buckets(max_rows)
        self.compiler = Compiler(self._lower)
        self.num_pages = dict(num_pages)
        self.pool = gemma.init_kv_pages(cfg, num_pages, page_size, self.dtype)
        zeros = jnp.zeros((max_rows,), jnp.uint32)
        state = renoise.initial_state(cfg, rcfg, zeros, zeros.astype(jnp.int32), self.dtype)._replace(
            finished=jnp.ones((max_rows,), bool))
        self.state = jax.tree.map(lambda a: jnp.array(a, copy=True), state)  # own buffers: the state is donated
        self.calls = {"encode": 0, "denoise": 0, "steps": 0}
        self._encode = jax.jit(functools.partial(gemma.encode_chunk, cfg=cfg), donate_argnames="kv_pages")
        self._denoise = jax.jit(functools.partial(_denoise_loop, cfg=cfg, rcfg=rcfg, backend=backend),
                                donate_argnames="state", static_argnames=("first_finish", "top_k"))

    # -- shapes -----------------------------------------------------------------------------------
    def encode_key(self, rows: int, longest: int, width: int) -> EncodeKey:
        return EncodeKey("encode", next_pow2(rows), max(MIN_CHUNK, next_pow2(longest)), next_pow2(width))

    def canvas_key(self, width: int, penalties: bool = False, top: bool = False) -> CanvasKey:
        return CanvasKey("canvas", next_pow2(width), penalties, top)

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
        keys = [CanvasKey("canvas", w, p, t) for p, t in variants for w in self.widths]
        keys += [EncodeKey("encode", 1, c, w) for c in self.chunks for w in self.widths if 2 * w * self.page_size >= c]
        keys += [EncodeKey("encode", r, canvas_chunk, w) for r in self.rows[1:] for w in self.widths]
        return keys

    def num_buckets(self, background: bool = False, **variants) -> int:
        return len(self.buckets(**variants))

    def warmup(self, *, on_bucket=None, background: bool = False, **variants) -> int:
        """Compile every bucket now (``background`` is accepted and ignored: no staged warm-up for canvases)."""
        return self.compiler.warmup(self.buckets(**variants), on_key=on_bucket)

    def _lower(self, key):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
        if key.kind == "encode":
            tables = {k: i32(key.rows, key.width) for k in self.num_pages}
            return self._encode.lower(self.params, tokens=i32(key.rows, key.chunk), prefix_len=i32(key.rows),
                                      num_tokens=i32(key.rows), kv_pages=self.pool, page_tables=tables)
        R = self.max_rows
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
        return None

    def pool_lost(self) -> bool:
        return any(a.is_deleted() for layer in self.pool for a in layer)

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
        self.pool = self._encode(self.params, tokens=jnp.asarray(tokens), prefix_len=jnp.asarray(starts),
                                 num_tokens=jnp.asarray(counts), kv_pages=self.pool,
                                 page_tables={k: jnp.asarray(v) for k, v in tables.items()})
        self.compiler.ran(key)
        self.calls["encode"] += 1

    def denoise(self, call: DenoiseCall) -> DenoiseResult:
        return self._collect_denoise(self._dispatch_denoise(call))

    def _dispatch_denoise(self, call: DenoiseCall):
        start = np.zeros(self.max_rows, bool)
        start[call.start_slots] = True
        key = self.canvas_key(next(iter(call.tables.values())).shape[1], call.adjust is not None, call.top)
        adjust = None
        if call.adjust is not None:
            adjust = renoise.Adjust(*(jnp.asarray(call.adjust[f]) for f in renoise_tables.FIELDS))
        self.state, steps = self._denoise(
            self.params, self.state, jnp.asarray(start), jnp.asarray(call.live), jnp.asarray(call.seeds),
            jnp.asarray(call.canvas_index), jnp.asarray(call.prefix_len), self.pool,
            {k: jnp.asarray(_pad(v, self.max_rows, key.width)) for k, v in call.tables.items()},
            jnp.int32(call.max_steps), adjust, first_finish=self.first_finish,
            top_k=MAX_TOP_LOGPROBS if call.top else 0)
        self.compiler.ran(key)
        return steps, call.top

    def _collect_denoise(self, pending) -> DenoiseResult:
        steps, top = pending
        s = self.state
        tops = (s.top_logprob, s.top_ids) if top else ()
        finished, argmax, logprob, steps, entropy, *tops = jax.device_get(
            (s.finished, s.argmax, s.logprob, steps, s.entropy, *tops))  # one transfer
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
                  adjust=None, *, cfg, rcfg, backend, first_finish, top_k=0):
    """Start the canvases of ``start`` slots, then run steps until a live row finishes (``first_finish``) or all
    live rows have, at most ``max_steps``. Slots not ``live`` are held finished (they do not change). ``adjust`` /
    ``top_k``: the penalty and top-k variants (:func:`dllm_jax.decode.renoise.denoise_step`)."""
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
                                  backend=backend, adjust=adjust, top_k=top_k)
        return st, i + 1, steps

    state, _, steps = jax.lax.while_loop(cond, body, (state, jnp.int32(0), jnp.zeros_like(prefix_len)))
    return state, steps
