"""The device side of the engine: owns the parameters and the KV page pool, pads host batches to buckets and
calls the jitted functions of :mod:`dllm_jax.decode.step`.

Every call is padded to a bucket and runs an executable of :mod:`dllm_jax.engine.compilation` (the buckets, the
step variants, warm-up and the compiles that run off the scheduler's thread).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decode.algorithms import Algorithm
from dllm_jax.engine.weight_sync import KIND_WEIGHTS, apply_received, update_template
from dllm_jax.decode.packing import RowLayout
from dllm_jax.decode import rows as row_schema
from dllm_jax.engine.calls import (UNCONSTRAINED, ROW_ATTRIBUTES, DecodeOutput, DecodeRow, DenoiseCall, PenaltyRow,
                                   Pending, PrefillCall, PrefillRow, RowError, fill_grammar, fill_penalties)
from dllm_jax.decode.step import (CHAIN_STOP_IDS, PENALTY_PREFIX, STATE_PREFIX, StepSpec, denoise_packed,
                                   init_kv_pages, prefill)
from dllm_jax.cache.pages import TRASH_PAGE
from dllm_jax.engine.compilation import (VARIANT_GRAMMAR, VARIANT_LOGPROBS, VARIANT_PENALTIES, VARIANT_TOP, Compiler,
                                         DenoiseKey, PrefillKey, ShapeBuckets, bucket_keys, fit_key, pick_bucket,
                                         prefill_fit, staged_keys, variants_for)
from dllm_jax.engine.sampling import MAX_TOP_LOGPROBS
from dllm_jax.model.compute_layout import ComputeCopies


KIND_STOP, KIND_PREFILL, KIND_DENOISE = 0, 1, 2
# Block chaining runs only in calls of at most this many decoding rows: it saves a host round trip per block, which
# matters when a call holds few rows, and costs every row of the call (reserved pages widen the page-table bucket;
# the loop carries each row's page table, prefix length and write page instead of reading them once). Measured on
# CPU, shipped model (`python -m bench chain`): 6% faster at 1 and 2 requests, 9% slower forced at 16. Only the row
# buckets such a call can land in compile the chaining step (``ModelRunner.chain_rows``); larger ones compile the
# plain FDFO step, so one executable serves each bucket either way.
CHAIN_MAX_ROWS = 2


@dataclasses.dataclass
class CallRecord:
    """One device call: its bucket (``rows`` x ``width`` pages, ``blocks`` per row) and its real content."""

    kind: str  # "denoise" | "prefill"
    rows: int
    width: int
    blocks: int
    real_rows: int
    real_blocks: int  # blocks of real tokens encoded (prefill) or rows (denoise)
    real_prefix_pages: int  # summed over the real rows
    refresh_rows: int
    sampled: bool
    iterations: int = 1  # forwards the call ran (the synchronous schedule loops on the device)
    max_prefix_pages: int = 0  # the longest real prefix of its rows (the XLA attention walks the table up to it)
    kv_only: int = 0  # of those, commit forwards that stopped after writing the K/V (decode/step.py::_one_step)


class ModelRunner:
    def __init__(self, params, cfg, *, block_size: int, mask_id: int, algorithm: Algorithm, num_pages: int,
                 max_rows: int, max_pages_per_row: int, max_prefill_blocks: int, loop: bool,
                 attention_backend: str = "xla", confidence_backend: str = "xla", kv_dtype=jnp.float32,
                 mesh=None, channel=None, fold_commit: bool = False, shape_buckets: dict | None = None,
                 chain_blocks: int = 0):
        self.params = params
        self.cfg = cfg
        self.block_size = block_size
        self.algorithm = algorithm
        self.buckets_spec = buckets = ShapeBuckets.build(
            max_rows=max_rows, max_pages_per_row=max_pages_per_row, max_prefill_blocks=max_prefill_blocks,
            fold_commit=fold_commit, custom=shape_buckets)
        self.row_buckets = buckets.rows
        self.width_buckets = buckets.pages
        # Prefill calls take the widest page table: both attentions walk only a row's real prefix (the table's
        # padding is never read), so a width per bucket would only multiply the prefill executables (27 row x
        # chunk pairs x 9 widths = 243 of a 50M model's 297 buckets at the default 8k context, most of its
        # cold start). Denoise calls keep their width buckets: their short prefixes use key tiles sized to them.
        self.prefill_width = buckets.pages[-1]
        self.max_pages_per_row = max_pages_per_row
        self.chunk_buckets = buckets.prefill_blocks
        self.max_prefill_blocks = buckets.prefill_budget
        self.prefill_row_buckets = buckets.prefill_rows
        self.mesh = mesh
        self.channel = channel  # multi-host: how the leader's step inputs reach the followers
        self.released: dict = {}  # release_memory_occupation: tag -> what was kept (dllm_jax.engine.released)
        self.kv_pages = init_kv_pages(cfg, num_pages, block_size, kv_dtype)
        self._num_pages, self._kv_dtype = num_pages, kv_dtype
        if mesh is not None:
            from dllm_jax.sharding import shard_kv_pages, shard_params

            self.params = shard_params(params, cfg, mesh)
            self.kv_pages = shard_kv_pages(self.kv_pages, cfg, mesh)
        self.compute = ComputeCopies.for_runner(self.params, mesh=mesh, multi_process=channel is not None)
        # The compiled steps see only what the device computes with: host-side fields (stop ids, the context
        # limit) are blanked, so models that differ only there share executables.
        device_cfg = cfg.replace(eos_token_ids=(), max_position_embeddings=0)
        base = StepSpec(model=device_cfg, block_size=block_size, mask_id=mask_id, algorithm=algorithm,
                        attention_backend=attention_backend, confidence_backend=confidence_backend, loop=loop,
                        first_done=not loop, mesh=mesh, fold_commit=fold_commit)
        self.greedy_spec = base
        self.sampling_spec = dataclasses.replace(base, sampling=True)
        self._variants: dict[tuple[bool, int, bool], StepSpec] = {}
        self.prefill_spec = dataclasses.replace(base, algorithm=None)
        self._fresh_state = {k: np.asarray(v)[0] for k, v in algorithm.init_state(1, block_size).items()}
        self.loop = loop
        self.chain = chain_blocks  # blocks a row may start on the device in one call (0: none)
        # The row buckets whose calls may chain: those of up to CHAIN_MAX_ROWS decoding rows (with commit folding,
        # each may bring a refresh row; the scheduler chains a synchronous call only when it holds one request).
        chain_rows = pick_bucket(min(CHAIN_MAX_ROWS * (2 if fold_commit else 1), self.row_buckets[-1]),
                                 self.row_buckets)
        self.chain_rows = frozenset(R for R in self.row_buckets if R <= chain_rows) if self.chain else frozenset()
        self._result_layouts = {chain: row_schema.result_layout(row_schema.Dims(block_size, C=self.chain),
                                                                self._fresh_state, chain=chain)
                                for chain in (False, True)}
        self._layouts: dict[tuple, RowLayout] = {}
        self._staged: dict[tuple, tuple] = {}  # see _staging
        self.device_calls = 0
        self.compiler = Compiler(self._lower, background=channel is None)
        # When a list (the efficiency bench sets one), every call appends a CallRecord: its bucket and how much
        # of it was real work, so a run can be set against the bare cost of its buckets.
        self.call_log: list | None = None
        # When a list (the host-overlap bench, bench/roofline.py), every denoise call appends its host timestamps
        # (perf_counter): (entered, dispatched, sync started, sync ended, returned): what the host did before the
        # dispatch, while the device ran, and after the result.
        self.timeline: list | None = None
        # On an accelerator, each denoise call's results start their copy to the host as soon as the call is
        # dispatched (queued behind the step on the device), so the read finds them on the host instead of starting
        # a device-to-host transfer once the host asks. XLA:CPU reads the buffer in place (an asynchronous copy there
        # costs ~0.1 ms a call), so not there; nor with followers (several processes), kept as they were.
        self.read_async = jax.default_backend() != "cpu" and channel is None

    # -------------------------------------------------------------------------------------------
    # Device calls. With several processes (multi-host), the leader sends every call's padded inputs to the
    # followers first, so all processes run the same SPMD program on the same data.
    def _execute(self, kind: int, arrays: dict[str, np.ndarray], shape: tuple[int, int, int]):
        """Run one device call. ``shape``: (rows, page-table width, tokens per row), what followers shape their
        arrays from (see :meth:`_template`). (A call whose executable was compiled ahead of time, by
        :meth:`_lower` ``.compile()``, finds it in JAX's caches and does not compile.)"""
        if self.channel is not None:
            self.channel.send(np.asarray([kind, *shape], np.int32), arrays)
        kind, variant = kind & 3, kind >> 2  # counted once dispatched (so the count says kv_pages is its output)
        if kind == KIND_PREFILL:
            args = (self.compute.view(self.params), self.kv_pages, arrays["tokens"], arrays["page_table"],
                    arrays["prefix_len"], arrays["write"])
            self.kv_pages = prefill(*args, spec=self.prefill_spec)
            self.device_calls += 1
            return None
        chain = shape[0] in self.chain_rows
        layout = self._layout_of(shape[1], variant, chain)
        rows = arrays["rows"]
        sampling = bool(np.any(row_schema.is_sampled(layout.view(rows, "temperature"), layout.view(rows, "top_k"))))
        spec = self.denoise_spec(sampling, variant, chain)
        args = (self.compute.view(self.params), self.kv_pages, rows)
        self.kv_pages, *result = denoise_packed(*args, spec=spec, layout=layout)
        self.device_calls += 1
        return result

    def can_chain(self, rows: int) -> bool:
        """Whether a denoise call of ``rows`` rows runs the chaining step (its row bucket is in ``chain_rows``)."""
        return pick_bucket(rows, self.row_buckets) in self.chain_rows

    def denoise_layout(self, width: int, penalties: bool, chain: bool = False, grammar: bool = False) -> RowLayout:
        """A denoise call's packed per-row inputs (:mod:`dllm_jax.decode.rows`), with the tables asked for."""
        key = (width, penalties, chain, grammar)
        if key not in self._layouts:
            self._layouts[key] = row_schema.layout(self._input_fields(penalties, chain, grammar), self._dims(width))
        return self._layouts[key]

    def _layout_of(self, width: int, variant: int, chain: bool) -> RowLayout:  # (``variant``: VARIANT_* bits)
        return self.denoise_layout(width, bool(variant & VARIANT_PENALTIES), chain, bool(variant & VARIANT_GRAMMAR))
    def _dims(self, width: int) -> row_schema.Dims:
        return row_schema.Dims(self.block_size, W=width, C=self.chain, G=(self.cfg.vocab_size + 31) // 32)

    def _input_fields(self, penalties: bool, chain: bool, grammar: bool = False) -> tuple:
        return row_schema.input_fields(self._dims(1), self._fresh_state, penalties=penalties, chain=chain,
                                       grammar=grammar)

    def _staging(self, width: int, penalties: bool, chain: bool, rows: int, grammar: bool = False):
        """For a call of ``rows`` rows of that ``denoise_layout``: its padding rows (they decode nothing), what its real
        rows start from; a host array they are written into, and its views. One set per bucket, kept."""
        key = (width, penalties, chain, grammar, rows)
        if key not in self._staged:
            fields = self._input_fields(penalties, chain, grammar)
            self._staged[key] = row_schema.padding_rows(fields, self._dims(width), rows)
        return self._staged[key]

    def denoise_spec(self, sampling: bool, variant: int = 0, chain: bool = False) -> StepSpec:
        """The compiled step for a call: plain (greedy or sampling), or a variant (``VARIANT_*`` bits); ``chain``:
        the chaining step (calls of the row buckets in ``chain_rows``)."""
        spec = self.sampling_spec if sampling else self.greedy_spec
        if not variant and not chain:
            return spec
        key = (sampling, variant, chain)
        if key not in self._variants:
            self._variants[key] = dataclasses.replace(
                spec, penalties=bool(variant & VARIANT_PENALTIES), grammar=bool(variant & VARIANT_GRAMMAR),
                logprobs=bool(variant & VARIANT_LOGPROBS),
                top_logprobs=MAX_TOP_LOGPROBS if variant & VARIANT_TOP else 0, chain=self.chain if chain else 0)
        return self._variants[key]

    def _template(self, header: np.ndarray) -> dict[str, np.ndarray]:
        """Zero arrays shaped like the leader's call (followers receive into them)."""
        kind, rows, width, length = (int(x) for x in header)
        kind, variant = kind & 3, kind >> 2
        if kind == KIND_WEIGHTS:
            return update_template(header)
        if kind == KIND_PREFILL:
            return {"tokens": np.zeros((rows, length), np.int32), "page_table": np.zeros((rows, width), np.int32),
                    "prefix_len": np.zeros((rows,), np.int32),
                    "write": np.zeros((rows, length // self.block_size), np.int32)}
        layout = self._layout_of(width, variant, rows in self.chain_rows)
        return {"rows": np.zeros((rows, layout.width), np.int32)}

    def follow(self) -> int:
        """Follower loop (every process but the leader): run each call the leader sends until it stops.
        Returns the number of calls run."""
        calls = 0
        while True:
            header, arrays = self.channel.recv(self._template)
            if int(header[0]) == KIND_STOP:
                return calls
            if int(header[0]) == KIND_WEIGHTS:  # a weight update, between two of the leader's rounds
                apply_received(self, arrays)
                continue
            self._execute_local(int(header[0]), arrays, tuple(int(x) for x in header[1:]))
            calls += 1

    def _execute_local(self, kind, arrays, shape):
        channel, self.channel = self.channel, None
        try:
            result = self._execute(kind, arrays, shape)
            if result is not None:
                jax.block_until_ready(result)
        finally:
            self.channel = channel

    def stop_followers(self) -> None:
        if self.channel is not None:
            self.channel.send(np.asarray([KIND_STOP, 0, 0, 0], np.int32), {})

    # -------------------------------------------------------------------------------------------
    def prefill_shape(self, num_rows: int, max_blocks: int) -> tuple[int, int]:
        """(rows, blocks per row) buckets for a prefill call; rows x blocks stays within the budget."""
        C = pick_bucket(max_blocks, self.chunk_buckets)
        R = pick_bucket(num_rows, self.buckets_spec.prefill_rows_for(C))
        return R, C

    def prefill_chunk(self, blocks: int) -> int:
        """Blocks per row for a prefill call whose longest row has ``blocks`` blocks to encode (capped by the
        budget): the smallest chunk bucket that holds them, unless more than a quarter of it would be padding
        (padded blocks cost a real block's FLOPs); then the largest bucket below, and the rest goes in the next
        round's call. A 33-block prompt runs as 32 + 1 blocks, not as one 64-block call half of padding. Chunks
        of at most 4 blocks always pad (an extra call costs more than a few padded blocks there)."""
        blocks = max(1, min(blocks, self.max_prefill_blocks))
        up = pick_bucket(blocks, self.chunk_buckets)
        below = [c for c in self.chunk_buckets if c <= blocks]
        if up <= 4 or 4 * (up - blocks) <= up or not below:
            return up
        return below[-1]

    def max_prefill_rows(self, chunk: int) -> int:
        """How many rows of ``chunk`` blocks one prefill call may carry."""
        return self.buckets_spec.prefill_rows_for(pick_bucket(chunk, self.chunk_buckets))[-1]

    def run(self, call: PrefillCall | DenoiseCall) -> DecodeOutput | None:
        """Execute one planned call (:mod:`dllm_jax.engine.calls`): :meth:`dispatch`, then :meth:`collect`."""
        return self.collect(self.dispatch(call))

    def dispatch(self, call: PrefillCall | DenoiseCall) -> Pending:
        """Start one planned call on the device and return at once (JAX dispatch is asynchronous): the caller may
        do host work until it :meth:`collect` s the result (a prefill's is None, a denoise call's its rows')."""
        if isinstance(call, PrefillCall):
            with jax.profiler.TraceAnnotation("prefill"):
                self.prefill(call.rows)
            return Pending(None)
        with jax.profiler.TraceAnnotation("denoise_step"):
            return Pending(self._dispatch_denoise(call.rows, loop_cap=call.loop_cap))

    @staticmethod
    def collect(pending: Pending):
        """Wait for a dispatched call's results (the one host sync of a denoise call) and unpack them."""
        return pending.collect() if pending.collect is not None else None

    def prefill(self, rows: list[PrefillRow]):
        """One prefill call over ``rows`` (writes their KV pages)."""
        B = self.block_size
        R, C = self.prefill_shape(len(rows), max(len(r.write_pages) for r in rows))
        W = self.prefill_width
        key = self.fit(PrefillKey("prefill", R, C, W))
        if key is not None:
            R, C = key.rows, key.blocks
        tokens = np.zeros((R, C * B), np.int32)
        table = np.full((R, W), TRASH_PAGE, np.int32)
        prefix = np.zeros((R,), np.int32)
        write = np.full((R, C), TRASH_PAGE, np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = r.tokens
            table[i, : len(r.prefix_pages)] = r.prefix_pages
            prefix[i] = len(r.prefix_pages) * B
            write[i, : len(r.write_pages)] = r.write_pages
        if self.call_log is not None:
            self.call_log.append(CallRecord("prefill", R, W, C, len(rows), sum(len(r.write_pages) for r in rows),
                                            sum(len(r.prefix_pages) for r in rows), 0, False,
                                            max_prefix_pages=max(len(r.prefix_pages) for r in rows)))
        self._execute(KIND_PREFILL, {"tokens": tokens, "page_table": table, "prefix_len": prefix, "write": write},
                      (R, W, C * B))
        self.compiler.ran(PrefillKey("prefill", R, C, W))

    def denoise(self, rows: list[DecodeRow], loop_cap: int = 1) -> DecodeOutput:
        """One denoise call over ``rows``: one step, or (FDFO) up to ``loop_cap`` steps until the first row with
        something to decode is done, or (sync) the whole block loop; returns a ``DecodeOutput``."""
        return self._dispatch_denoise(rows, loop_cap)()

    def _dispatch_denoise(self, rows: list[DecodeRow], loop_cap: int) -> Callable[[], DecodeOutput]:
        """Dispatch a denoise call; returns what reads and unpacks its results."""
        timeline = self.timeline
        t_enter = time.perf_counter() if timeline is not None else 0.0
        B = self.block_size
        n = len(rows)
        penalties = any(r.penalty is not None for r in rows)
        grammar = any(r.grammar is not None for r in rows)
        variant = (VARIANT_PENALTIES if penalties else 0) | (VARIANT_GRAMMAR if grammar else 0)
        if any(r.logprobs >= 0 for r in rows):
            variant |= VARIANT_LOGPROBS | (VARIANT_TOP if any(r.logprobs > 0 for r in rows) else 0)
        sampled = any(row_schema.is_sampled(r.temperature, r.top_k) for r in rows)
        # The table holds the prefix and, for a chaining row, the pages of the blocks it may start (bucket: fit).
        pages = max(1, max(len(r.prefix_pages) + len(r.chain_pages) for r in rows))
        key = DenoiseKey("denoise", pick_bucket(n, self.row_buckets), pick_bucket(pages, self.width_buckets),
                         sampled, variant)
        key = self.fit(key) or key
        R, W = key.rows, key.width
        chain = R in self.chain_rows
        padding, staging, fields = self._staging(W, penalties, chain, R, grammar)
        np.copyto(staging, padding)
        fields["loop_cap"][:] = loop_cap
        state = {k: fields[STATE_PREFIX + k] for k in self._fresh_state}
        for i, r in enumerate(rows):
            try:
                self._fill_row(fields, state, i, r, chain, R)
            except Exception as e:  # a value the checks let through: that row's request fails, not the call's
                raise RowError(i, e) from e
        if penalties:
            fill_penalties(rows, {k[len(PENALTY_PREFIX):]: v for k, v in fields.items()
                                   if k.startswith(PENALTY_PREFIX)})
        if grammar:
            fill_grammar(rows, fields)
        packed = staging.copy()  # the call's own inputs (the staging rows are rewritten by the next call)
        result = self._execute(KIND_DENOISE | (variant << 2), {"rows": packed}, (R, W, B))
        if self.read_async:
            for leaf in jax.tree.leaves(result):
                leaf.copy_to_host_async()
        t_dispatched = time.perf_counter() if timeline is not None else 0.0
        self.compiler.ran(key)
        return functools.partial(self._collect_denoise, result, rows, chain, R, W, sampled, t_enter, t_dispatched)

    def _collect_denoise(self, result, rows: list[DecodeRow], chain: bool, R: int, W: int, sampled: bool,
                         t_enter: float, t_dispatched: float) -> DecodeOutput:
        timeline, n = self.timeline, len(rows)
        t_sync = time.perf_counter() if timeline is not None else 0.0
        # The one host sync of this step. np.array, not jax.device_get: on XLA:CPU it reads the buffer directly
        # (~1 us; device_get's asynchronous copy costs ~0.1 ms a call).
        results, record = np.array(result[0]), jax.tree.map(np.asarray, result[1])
        t_synced = time.perf_counter() if timeline is not None else 0.0
        res = self._result_layouts[chain].unpack(results[:n])
        forwards, chained = res["steps"], np.zeros(n, np.int64)
        if chain:
            chained = res["chain_blocks"]
            forwards = forwards + res["chain_steps"].sum(axis=1)
        if self.call_log is not None:
            self.call_log.append(CallRecord("denoise", R, W, 1, n, n, sum(len(r.prefix_pages) for r in rows),
                                            sum(r.refresh for r in rows), sampled, int(forwards.max()),
                                            max(len(r.prefix_pages) + int(c) for r, c in zip(rows, chained)),
                                            int(res["kv_only"][0])))
        states = [{k: res[STATE_PREFIX + k][i] for k in self._fresh_state} for i in range(n)]
        out = DecodeOutput(tokens=res["tokens"], done=res["done"], steps=res["steps"], states=states,
                           fresh_kv=res["fresh_kv"], forwards=forwards)
        if chain:
            out.chain_blocks, out.chain_tokens, out.chain_steps = chained, res["chain_tokens"], res["chain_steps"]
        if record is not None:
            out.logprob, out.recorded = np.asarray(record.logprob[:n]), np.asarray(record.recorded[:n])
            if record.top_ids is not None:
                out.top_logprob, out.top_ids = np.asarray(record.top_logprob[:n]), np.asarray(record.top_ids[:n])
        if timeline is not None:
            timeline.append((t_enter, t_dispatched, t_sync, t_synced, time.perf_counter()))
        return out

    def _fill_row(self, fields: dict, state: dict, i: int, r: DecodeRow, chain: bool, R: int) -> None:
        """Write row ``i`` of a denoise call into the staging views (numpy checks each value against its dtype)."""
        for name in ROW_ATTRIBUTES:  # the input fields a DecodeRow holds under their own name
            value = getattr(r, name)
            if value is not None:  # (None: the padding the staging row already holds)
                fields[name][i] = value
        fields["page_table"][i, : len(r.prefix_pages)] = r.prefix_pages
        fields["prefix_len"][i] = len(r.prefix_pages) * self.block_size
        if r.algo_state is not None:
            for k, v in r.algo_state.items():
                state[k][i] = v
        if r.chain_pages:
            if not chain or len(r.chain_pages) > self.chain or len(r.stop_ids) > CHAIN_STOP_IDS:
                raise ValueError(f"chain tables overflow: {len(r.chain_pages)} pages (room for "
                                 f"{self.chain if chain else 0} in a call of {R} rows), {len(r.stop_ids)} stop "
                                 f"ids (room for {CHAIN_STOP_IDS})")
            fields["chain_pages"][i, :len(r.chain_pages)] = r.chain_pages
            fields["chain_left"][i] = len(r.chain_pages)
            fields["stop_ids"][i, :len(r.stop_ids)] = r.stop_ids

    def pool_lost(self) -> bool:
        """After a device call raised: whether the KV pool went with it (it is donated to every call, so a failure
        once the call started leaves no pool). Then a fresh, empty pool replaces it and every cached or running
        request's KV is gone (the scheduler fails the running requests and empties the prefix index)."""
        if not any(x.is_deleted() for x in jax.tree.leaves(self.kv_pages)):
            return False
        kv_pages = init_kv_pages(self.cfg, self._num_pages, self.block_size, self._kv_dtype)
        if self.mesh is not None:
            from dllm_jax.sharding import shard_kv_pages

            kv_pages = shard_kv_pages(kv_pages, self.cfg, self.mesh)
        self.kv_pages = kv_pages
        return True

    # -------------------------------------------------------------------------------------------
    # Which executables exist, and compiling the missing ones off the scheduler's thread
    # -------------------------------------------------------------------------------------------
    def denoise_key(self, rows: int, pages: int, *, sampling: bool, penalties: bool, logprobs: bool,
                    top: bool, grammar: bool = False, ask: bool = True) -> DenoiseKey:
        """The key of a denoise call of ``rows`` rows whose longest page table holds ``pages``: its smallest bucket,
        or a larger compiled one while a staged warm-up compiles that (:meth:`fit`)."""
        key = DenoiseKey("denoise", pick_bucket(rows, self.row_buckets), pick_bucket(max(1, pages), self.width_buckets),
                         sampling, variants_for(penalties=penalties, logprobs=logprobs, top=top, grammar=grammar))
        return self.fit(key, ask) or key

    def fit(self, key: tuple, ask: bool = True) -> tuple | None:
        """The key a call of ``key``'s shape runs under now: ``key``, or while a staged warm-up compiles it a larger
        compiled bucket, or None: the call waits (:func:`compilation.fit_key`)."""
        return fit_key(self.compiler, key, lambda: self.buckets_spec.larger(key, self.chain_rows), ask)

    def prefill_fit(self, chunk: int, rows: int) -> tuple[int, int] | None:  # see compilation.prefill_fit
        return prefill_fit(self.compiler, self.buckets_spec, chunk, rows, self.prefill_width)

    def _abstract(self, tree):
        """Shapes of device arrays, as the jitted call sees them (a sharding only where a mesh placed them: a
        single device's arrays lower without one, and so must these, for the call to find the executable)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding if self.mesh is not None else None), tree)

    def _lower(self, key: tuple):
        """Trace and lower the call of ``key`` from abstract inputs (shapes only: no host staging array and no
        device buffer is touched, so this may run on another thread while calls run)."""
        params, kv_pages = self.compute.abstract(self._abstract(self.params)), self._abstract(self.kv_pages)
        if key.kind == "prefill":
            R, C, W = key.rows, key.blocks, key.width
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
            return prefill.lower(params, kv_pages, i32(R, C * self.block_size), i32(R, W), i32(R), i32(R, C),
                                 spec=self.prefill_spec)
        R, W, sampling, variant = key.rows, key.width, key.sampled, key.variant
        chain = R in self.chain_rows
        layout, spec = self._layout_of(W, variant, chain), self.denoise_spec(sampling, variant, chain)
        return denoise_packed.lower(params, kv_pages, jax.ShapeDtypeStruct((R, layout.width), np.int32), spec=spec,
                                    layout=layout)

    # -------------------------------------------------------------------------------------------
    def buckets(self, **variants) -> list[tuple]:
        """Every key a call can take, with the step variants asked for (:func:`compilation.bucket_keys`)."""
        return bucket_keys(self.buckets_spec, self.prefill_width, **variants)

    def num_buckets(self, background: bool = False, **variants) -> int:  # how many keys warmup compiles now
        return len(self._warmup_keys(background, **variants)[0])

    def _warmup_keys(self, background: bool, **variants) -> tuple[list[tuple], list[tuple]]:
        keys = self.buckets(**variants)
        if not background or self.channel is not None:
            return keys, []
        return staged_keys(keys, denoise_rows=2 if self.greedy_spec.fold_commit else 1, block_size=self.block_size)

    def warmup(self, *, on_bucket=None, background: bool = False, **variants) -> int:
        """Compile every bucket now, with the step variants asked for (:meth:`Compiler.warmup`); ``background``: a
        short chat's now, the rest on the background thread (:func:`compilation.staged_keys`). Returns the count
        compiled now. With followers each bucket runs once instead, so that every process compiles it, all now."""
        keys, later = self._warmup_keys(background, **variants)  # (sampling, logprobs, penalties, grammar)
        run = self._run_padding if self.channel is not None else None
        count = self.compiler.warmup(keys, later=later, on_key=on_bucket, run=run)
        jax.block_until_ready(self.kv_pages)
        return count

    def _run_padding(self, key: tuple) -> None:
        """Run one call of ``key`` over padding rows (they write to the trash page)."""
        B = self.block_size
        if key.kind == "denoise":
            lps = -1 if not key.variant & VARIANT_LOGPROBS else (1 if key.variant & VARIANT_TOP else 0)
            row = DecodeRow(prefix_pages=[TRASH_PAGE] * key.width, temperature=1.0 if key.sampled else 0.0,
                            logprobs=lps, penalty=PenaltyRow([], 0) if key.variant & VARIANT_PENALTIES else None,
                            grammar=UNCONSTRAINED if key.variant & VARIANT_GRAMMAR else None)
            self.denoise([row] * key.rows)
        else:
            self.prefill([PrefillRow(tokens=[0] * (key.blocks * B), prefix_pages=[TRASH_PAGE] * key.width,
                                     write_pages=[TRASH_PAGE] * key.blocks)] * key.rows)
