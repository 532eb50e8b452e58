"""The jitted device functions: prefill of committed blocks and the denoise step.

Everything here is pure and shape-static: the host pads a batch to a bucket (rows, page-table width, prefill
blocks) and calls one of the functions below; the KV page pool is donated so its pages are updated in place.

* :func:`prefill` encodes chunks of complete blocks of real tokens (several blocks per row, block-causal inside
  the chunk) and writes their K/V; nothing is decoded.
* :func:`denoise` runs the model over each row's current block, turns the hidden states into candidates
  (argmax / sampled token and confidence, the mask id excluded), applies the algorithm under the explicit
  ``immutable`` mask and writes the block's K/V. With ``spec.loop`` it repeats that on the device
  (``lax.while_loop``) until every row is done: the synchronous schedule, with no host round trip per step.
  With ``spec.first_done`` (the FDFO schedule) it repeats it only until the first row with something to decode
  is done, or ``batch.loop_cap`` steps: exactly the steps single-step rounds would run before that row leaves
  the batch, without a host round trip between them. The host asks for one step (cap 1) when the batch must
  change sooner: a request waits to join, a row streams its provisional block, a refresh row rides along.

Two optional features compile as separate variants of the step (static fields of :class:`StepSpec`), so a batch
that uses neither runs exactly the plain step: ``penalties`` (the batch carries :class:`Penalties`; see
:mod:`dllm_jax.decode.penalties`) and ``logprobs`` / ``top_logprobs`` (the result carries, per position, the log
probability of the token a step wrote and the alternatives of that same forward; see
:mod:`dllm_jax.decode.logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.decode.algorithms import Algorithm, Candidates, State
from dllm_jax.decode.algorithms import entropy as entropy_of
from dllm_jax.decode import grammar_mask as gm
from dllm_jax.decode import logprobs as lp
from dllm_jax.decode.backends import attention_function, confidence_stats
from dllm_jax.decode.draw import _filter_top_k_top_p, _sample  # noqa: F401 (tests import the filter from here)
from dllm_jax.decode import rows
from dllm_jax.decode.rows import is_sampled
from dllm_jax.decode.packing import RowLayout
from dllm_jax.decode.penalties import apply_penalties
from dllm_jax.model.family import ModelFamily, family_of


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static description of a compiled step (hashable: part of the jit cache key)."""

    model: ModelConfig
    block_size: int
    mask_id: int
    algorithm: Algorithm | None = None
    attention_backend: str = "xla"
    confidence_backend: str = "xla"
    sampling: bool = False  # some row samples (temperature > 0): full logits are materialised
    loop: bool = False  # synchronous schedule: loop on the device until every row is done
    # FDFO on the device: repeat the step until the first row with something to decode is done (or
    # ``batch.loop_cap`` steps): the rows of the batch would not change before then, so the host round trip
    # between those steps is saved. The host passes a cap of 1 when it wants the batch back after one step.
    first_done: bool = False
    mesh: Any = None  # jax.sharding.Mesh for tensor / expert parallelism (None: one device)
    # Fold the commit forward: a row whose update leaves nothing to decode is done at once (for foldable
    # algorithms), with ``fresh_kv`` False; the host re-encodes the block as a "refresh row" inside the next
    # call, where the next block reads it (the model writes K/V before attending), saving one sequential
    # forward per block with identical tokens.
    fold_commit: bool = False
    penalties: bool = False  # the batch carries Penalties (some row has a penalty or bias)
    # The batch carries GrammarMask (some row is constrained: decode/grammar_mask.py). A looping call stops after
    # the step in which an active row decides its frontier (the host checks the run and computes the next mask).
    grammar: bool = False
    logprobs: bool = False  # record the log probability of every token a step writes
    top_logprobs: int = 0  # and the k most likely alternatives of that forward (0: none)
    # Block chaining: a row whose block is done, with no stop token in it, starts its next block on the device in
    # the same call (up to ``batch.chain_left`` of them, in the pages ``batch.chain_pages`` the host reserved), so
    # a request that nothing else waits on writes several blocks per host round trip. The width of the chain
    # tables (0: no chaining). With ``loop`` the call then ends when every row is done and none goes on (the
    # scheduler chains a synchronous call only when it holds one request).
    chain: int = 0

    def __post_init__(self):
        if self.chain and not (self.first_done or self.loop):
            raise ValueError("StepSpec.chain: only a looping step (first_done or loop) chains blocks")

    @property
    def needs_logits(self) -> bool:
        """Whether the step materialises the ``[R, B, V]`` logits (else only the fused confidence figures)."""
        algo = self.algorithm
        return self.sampling or self.penalties or algo.needs_logits or algo.needs_entropy  # (not grammar: it reads
        # the logits at the frontier alone)

    @property
    def max_steps(self) -> int:
        # Two beyond the algorithm's own cap: one forced fill of leftover masks, one forward that writes their KV.
        return self.algorithm.max_steps(self.block_size) + 2


# One padded batch of rows (requests), each holding its current block: its fields are declared once, in
# dllm_jax/decode/rows.py (INPUTS, CHAIN_INPUTS; ``penalties`` in that variant; ``loop_cap`` a scalar).
DenoiseBatch = rows.DenoiseBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenoiseResult:
    tokens: jax.Array  # [R, B]
    done: jax.Array  # [R] bool
    steps: jax.Array  # [R] int32: forwards that served each row in this call
    state: State
    fresh_kv: jax.Array  # [R] bool: the block's page holds the KV of its final tokens (else: refresh it)
    logprobs: lp.LogprobRecord | None = None  # only in the logprobs variant
    # [R] int32, the same in every row: forwards of this call that were commit forwards (K/V only, see _one_step)
    kv_only: jax.Array | None = None
    # With ``spec.chain``: the blocks a row completed and chained past in this call, oldest first (``tokens``,
    # ``steps`` and the rest describe the row's block after them).
    chain_blocks: jax.Array | None = None  # [R] int32
    chain_tokens: jax.Array | None = None  # [R, C, B]
    chain_steps: jax.Array | None = None  # [R, C] int32: forwards each of those blocks took in this call


RNG_STEPS_PER_BLOCK = 4096  # a step's sampling key folds in block index x this + step in block (see the scheduler)
CHAIN_STOP_IDS = rows.CHAIN_STOP_IDS


def _attention(spec: StepSpec):
    return attention_function(spec.attention_backend, spec.mesh, spec.model)


def _family(spec: StepSpec) -> ModelFamily:
    """The model's family, whose device functions the step traces (a Python lookup at trace time: no jit argument,
    the same program as calling them directly)."""
    return family_of(spec.model)


def _model_forward(params, kv_pages, tokens, page_table, prefix_len, write_pages, spec: StepSpec):
    return _family(spec).forward_chunk(params, spec.model, tokens, kv_pages, page_table, prefix_len, write_pages,
                                       block_size=spec.block_size, attention_fn=_attention(spec))


def _model_forward_kv(params, kv_pages, tokens, page_table, prefix_len, write_pages, spec: StepSpec):
    """The part of :func:`_model_forward` that writes K/V (returns (kv_pages, the last layer's inputs))."""
    return _family(spec).forward_chunk_kv(params, spec.model, tokens, kv_pages, page_table, prefix_len, write_pages,
                                          block_size=spec.block_size, attention_fn=_attention(spec))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("kv_pages",))
def prefill(params, kv_pages, tokens, page_table, prefix_len, write_pages, *, spec: StepSpec):
    """Encode ``tokens [R, C*B]`` (C complete blocks per row) after each row's prefix; write their K/V."""
    with jax.named_scope("prefill"):
        _, kv_pages = _model_forward(params, kv_pages, tokens, page_table, prefix_len, write_pages, spec)
    return kv_pages


# ----------------------------------------------------------------------------------------------
# Candidates: argmax or sampled token, and its confidence, with the mask id excluded
# ----------------------------------------------------------------------------------------------

def _exclude_mask(logits, mask_id):
    return logits.at[..., mask_id].set(-jnp.inf)


@dataclasses.dataclass
class _Scores:
    """What the logprob figures of a step are computed from (see :mod:`dllm_jax.decode.logprobs`)."""

    logits: jax.Array | None  # [R, B, V] tempered logits, when the step materialised them
    hidden: jax.Array | None  # [R, B, H] otherwise, with the confidence path's lse
    lse: jax.Array | None  # [R, B]
    frontier: Any = None  # grammar_mask.FrontierScores: a constrained frontier's masked distribution


def candidates(params, hidden, batch: DenoiseBatch, spec: StepSpec) -> tuple[Candidates, _Scores | None]:
    rows, block, dim = hidden.shape
    algo = spec.algorithm
    with jax.named_scope("confidence"):
        # The greedy figures always come from the configured confidence backend, so a greedy row is
        # bit-identical whether or not a sampled (or penalised) row shares its batch.
        argmax, p_max, lse = confidence_stats(spec.confidence_backend, params, hidden.reshape(rows * block, dim),
                                              exclude_token_id=spec.mask_id, mesh=spec.mesh, cfg=spec.model)
        tokens, confidence = argmax.reshape(rows, block), p_max.reshape(rows, block)
        if not spec.needs_logits:
            scores = _Scores(None, hidden, lse.reshape(rows, block)) if spec.logprobs else None
            cand = Candidates(tokens=tokens, confidence=confidence)
            return _constrain(params, hidden, None, batch, cand, spec, scores)
        logits = _family(spec).logits_from_hidden(params, hidden)
        logits = _exclude_mask(logits, spec.mask_id)
        if spec.penalties:
            pen = batch.penalties
            logits = apply_penalties(logits, batch.tokens, batch.immutable, batch.prefix_len, pen, spec.mask_id)
            top = jnp.max(logits, axis=-1)
            penalised = pen.active[:, None]
            tokens = jnp.where(penalised, jnp.argmax(logits, axis=-1).astype(jnp.int32), tokens)
            confidence = jnp.where(penalised, jnp.exp(top - jax.nn.logsumexp(logits, axis=-1)), confidence)
        entropy = entropy_of(logits, algo.entropy_eps) if algo.needs_entropy else None
        sampled_rows = is_sampled(batch.temperature, batch.top_k)  # top-k 1 is greedy: it edits as one
        if spec.sampling:
            drawn, relative = _sample(logits, batch)
            tokens = jnp.where(sampled_rows[:, None], drawn, tokens)
            confidence = jnp.where(sampled_rows[:, None], jnp.minimum(confidence, relative), confidence)
        scores = None
        if spec.logprobs:
            tempered = logits
            if spec.sampling:  # greedy rows (temperature 0, or top_k 1) score at temperature 1
                t = jnp.where(is_sampled(batch.temperature, batch.top_k), batch.temperature, 1.0)
                tempered = logits / t[:, None, None]
            scores = _Scores(tempered, None, None)
        cand = Candidates(tokens=tokens, confidence=confidence, entropy=entropy,
                          logits=logits if algo.needs_logits else None, sampled=sampled_rows)
        return _constrain(params, hidden, logits, batch, cand, spec, scores)


def _constrain(params, hidden, logits, batch: DenoiseBatch, cand: Candidates, spec: StepSpec, scores):
    """The grammar variant: each constrained row's frontier candidate (:func:`grammar_mask.constrain`), and the
    masked distribution the logprob record reports there."""
    if not spec.grammar:
        return cand, scores
    t = jnp.where(is_sampled(batch.temperature, batch.top_k), batch.temperature, 1.0) if spec.sampling else (
        jnp.ones_like(batch.temperature, jnp.float32))  # (the record's scoring temperature, as below)
    with jax.named_scope("grammar"):
        cand, front = gm.constrain(hidden, logits, batch, cand, mask_id=spec.mask_id,
                                   head=lambda h: _family(spec).logits_from_hidden(params, h),
                                   sample=(lambda z3: _sample(z3, batch)[0]) if spec.sampling else None,
                                   temperature=t if spec.logprobs else None)
    return cand, (dataclasses.replace(scores, frontier=front) if scores is not None else None)


def _record(params, scores: _Scores, old_tokens, new_tokens, spec: StepSpec) -> lp.LogprobRecord:
    """The logprob figures of the tokens this step wrote (every position scored; ``recorded`` where it wrote)."""
    from dllm_jax.sharding import vocab_shards

    shards = vocab_shards(spec.model, spec.mesh)
    k = spec.top_logprobs
    with jax.named_scope("logprobs"):
        if scores.logits is not None:
            chosen, vals, ids = lp.from_logits(scores.logits, new_tokens, k, spec.mesh, shards)
        else:
            rows, block, dim = scores.hidden.shape
            chosen, vals, ids = lp.from_hidden(params, scores.hidden.reshape(rows * block, dim),
                                               new_tokens.reshape(-1), scores.lse.reshape(-1), k,
                                               mask_id=spec.mask_id, mesh=spec.mesh, vocab_shards=shards)
            chosen = chosen.reshape(rows, block)
            if k:
                vals, ids = vals.reshape(rows, block, k), ids.reshape(rows, block, k)
    if scores.frontier is not None:  # a constrained frontier: the masked distribution its token came from
        chosen, vals, ids = gm.record_frontier(scores.frontier, new_tokens, chosen, vals, ids, (
            lambda z: lp.top_k_last_axis(z, k, spec.mesh, shards)) if k else None)
    wrote = (new_tokens != old_tokens) & (new_tokens != spec.mask_id)
    return lp.LogprobRecord(logprob=chosen, top_logprob=vals, top_ids=ids, recorded=wrote)


# ----------------------------------------------------------------------------------------------
# The denoise step
# ----------------------------------------------------------------------------------------------

def _one_step(params, kv_pages, batch: DenoiseBatch, tokens, state, steps_taken, spec: StepSpec):
    """Forward over the blocks, then one algorithm update. Returns (kv_pages, tokens, done, fresh_kv, state,
    logprob record or None, whether it was a K/V-only commit forward).

    A commit forward stops once it has written the K/V: when no row of the call has a position left to decode, a
    foldable algorithm's update is known before the forward (nothing changes, every row is done, its K/V now
    exact), so the rest of the forward (the last layer's attention and MLP, the head, the confidence selection)
    runs under a ``lax.cond`` that skips it. The K/V come from the same computation either way. At one request on
    CPU this is the last of every block's ~4-5 forwards (bench/RESULTS.md)."""
    kv_pages, last = _model_forward_kv(params, kv_pages, tokens, batch.page_table, batch.prefix_len,
                                       batch.write_page[:, None], spec)

    def decode(last):
        hidden = _family(spec).forward_chunk_rest(params, spec.model, last, kv_pages, batch.page_table,
                                                  batch.prefix_len, block_size=spec.block_size,
                                                  attention_fn=_attention(spec))
        return _update(params, hidden, batch, tokens, state, steps_taken, spec)

    if not spec.algorithm.foldable:
        return (kv_pages, *decode(last), jnp.bool_(False))

    def settled_update(last):
        """What :func:`_update` returns when no row has anything left to decode."""
        done = jnp.ones(tokens.shape[:1], jnp.bool_)
        record = lp.empty_record(*tokens.shape, spec.top_logprobs) if spec.logprobs else None
        return tokens, done, done, state, record

    settled = ~jnp.any((tokens == spec.mask_id) & ~batch.immutable)
    return (kv_pages, *jax.lax.cond(settled, settled_update, decode, last), settled)


def _update(params, hidden, batch: DenoiseBatch, tokens, state, steps_taken, spec: StepSpec):
    """Candidates from the hidden states, then the algorithm. Returns (tokens, done, fresh_kv, state, record)."""
    step_batch = dataclasses.replace(batch, tokens=tokens,
                                     rng_step=batch.rng_step + steps_taken - batch.steps_taken)
    cand, scores = candidates(params, hidden, step_batch, spec)
    cap = spec.algorithm.max_steps(spec.block_size)
    # Safety net (never reached by a correct algorithm): past the cap, fill what is left, then freeze.
    freeze = steps_taken >= cap + 1
    immutable = batch.immutable | freeze[:, None]
    with jax.named_scope("algorithm"):
        new_tokens, done, state = spec.algorithm.step(tokens, immutable, cand, state, spec.mask_id)
    fill = (steps_taken >= cap) & ~freeze
    leftover = fill[:, None] & (new_tokens == spec.mask_id) & ~batch.immutable
    new_tokens = jnp.where(leftover, cand.tokens, new_tokens)
    done = done & ~jnp.any(leftover | (fill[:, None] & (new_tokens != tokens)), axis=-1)
    if spec.grammar:
        new_tokens = gm.keep_run(tokens, new_tokens, batch.immutable, batch.grammar.active, mask_id=spec.mask_id)
    fresh = done
    if spec.fold_commit and spec.algorithm.foldable:
        resolved = ~jnp.any((new_tokens == spec.mask_id) & ~immutable, axis=-1)
        done = done | resolved
    record = _record(params, scores, tokens, new_tokens, spec) if spec.logprobs else None
    return new_tokens, done, fresh, state, record


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("kv_pages",))
def denoise(params, kv_pages, batch: DenoiseBatch, state: State, *, spec: StepSpec):
    """One denoise step, the steps until the first row is done (``spec.first_done``, FDFO) or the whole block loop
    (``spec.loop``, synchronous). Returns (kv_pages, result). With ``spec.chain`` (FDFO) a row that is done may go
    on into its next block instead (see :func:`_start_next_blocks`); the call then ends when the first row is done
    and cannot go on.

    With ``spec.logprobs`` the result's record holds, per position, the figures of the step that last wrote it
    during this call (the synchronous loop carries them, so each committed position keeps the forward in which it
    was written)."""
    if not (spec.loop or spec.first_done):
        kv_pages, tokens, done, fresh, state, record, settled = _one_step(
            params, kv_pages, batch, batch.tokens, state, batch.steps_taken, spec)
        return kv_pages, DenoiseResult(tokens=tokens, done=done, steps=jnp.ones_like(batch.steps_taken),
                                       state=state, fresh_kv=fresh, logprobs=record,
                                       kv_only=_per_row(settled.astype(jnp.int32), batch))

    live = ~jnp.all(batch.immutable, axis=-1)  # rows with something to decode (not padding, not refresh rows)
    chain = spec.chain
    max_iterations = spec.max_steps * (chain + 1)

    def cond(c):  # (grammar: until a constrained row decides its frontier, whose next mask the host computes)
        go = _cond(c["done"], c["it"])
        return go & ~c["frontier_moved"] if spec.grammar else go

    def _cond(done, it):
        if spec.first_done:
            return (it < jnp.minimum(max_iterations, batch.loop_cap)) & ~jnp.any(done & live) & ~jnp.all(done)
        return (it < max_iterations) & ~jnp.all(done)

    def body(c):
        # The row's current block: the call's own, or (chaining) a later one started on the device.
        row = dataclasses.replace(batch, tokens=c["tokens"], **{k: c[k] for k in _ROW_FIELDS if k in c})
        kv, new_tokens, new_done, new_fresh, new_state, new_record, settled = _one_step(
            params, c["kv"], row, c["tokens"], c["state"], row.steps_taken + c["steps"], spec)
        done = c["done"]
        if chain:  # a row that will start another block does not fold: it runs the forward writing its exact KV
            chains = (c["chain_used"] < batch.chain_left) & ~_stop_hit(new_tokens, row, batch)
            new_done = new_done & (new_fresh | ~chains)
        # Rows already done ride along unchanged. Their page is rewritten: from identical tokens, so a row whose
        # KV was fresh stays fresh; a folded row (done, KV not yet fresh) becomes fresh if any later iteration ran.
        keep = done[:, None]
        out = dict(c, kv=kv, it=c["it"] + 1, tokens=jnp.where(keep, c["tokens"], new_tokens),
                   state=_where_rows(done, c["state"], new_state), fresh=jnp.where(done, True, new_fresh),
                   steps=c["steps"] + (~done).astype(jnp.int32), done=done | new_done,
                   kv_only=c["kv_only"] + settled.astype(jnp.int32))
        if spec.grammar:
            out["frontier_moved"] = gm.frontier_decided(c["tokens"], new_tokens, row.immutable,
                                                        batch.grammar.active & ~done, spec.mask_id)
        if c["record"] is not None:
            out["record"] = lp.merge(c["record"], new_record, keep)
        if chain:
            out = _start_next_blocks(out, row, go=new_done & ~done & live & out["fresh"] & chains, batch=batch,
                                     spec=spec)
        return out

    zeros = jnp.zeros_like(batch.steps_taken)
    no = jnp.zeros(batch.tokens.shape[:1], jnp.bool_)
    record = lp.empty_record(*batch.tokens.shape, spec.top_logprobs) if spec.logprobs else None
    init = dict(kv=kv_pages, tokens=batch.tokens, done=no, fresh=no, state=state, steps=zeros, it=jnp.int32(0),
                record=record, kv_only=jnp.int32(0))
    if spec.grammar:
        init["frontier_moved"] = jnp.bool_(False)
    if chain:
        rows, block = batch.tokens.shape
        init.update({k: getattr(batch, k) for k in _ROW_FIELDS}, chain_used=zeros,
                    chain_tokens=jnp.full((rows, chain, block), spec.mask_id, jnp.int32),
                    chain_steps=jnp.zeros((rows, chain), jnp.int32))
    c = jax.lax.while_loop(cond, body, init)
    result = DenoiseResult(tokens=c["tokens"], done=c["done"], steps=c["steps"], state=c["state"],
                           fresh_kv=c["fresh"], logprobs=c["record"], kv_only=_per_row(c["kv_only"], batch))
    if chain:
        result.chain_blocks, result.chain_tokens, result.chain_steps = (c["chain_used"], c["chain_tokens"],
                                                                        c["chain_steps"])
    return c["kv"], result


def _per_row(scalar, batch: DenoiseBatch):
    return jnp.broadcast_to(scalar, batch.steps_taken.shape)


# The per-row batch fields that change when a row starts its next block on the device.
_ROW_FIELDS = ("immutable", "page_table", "prefix_len", "write_page", "steps_taken", "rng_step")


def _where_rows(rows, old: State, new: State) -> State:
    """Per row: ``old`` where ``rows``, else ``new`` (algorithm states: leaves ``[R, ...]``)."""
    return jax.tree.map(lambda o, n: jnp.where(rows.reshape((-1,) + (1,) * (o.ndim - 1)), o, n), old, new)


def _stop_hit(tokens, row: DenoiseBatch, batch: DenoiseBatch):
    """[R] bool: the row generated one of its stop ids in this block (its generation ends with the block)."""
    hit = jnp.any(tokens[:, :, None] == batch.stop_ids[:, None, :], axis=-1)
    return jnp.any(hit & ~row.immutable, axis=-1)


def _start_next_blocks(c: dict, row: DenoiseBatch, *, go, batch: DenoiseBatch, spec: StepSpec) -> dict:
    """Chaining: every row in ``go`` (it finished its block in this iteration, with its KV exact, no stop id among
    the tokens it generated and a reserved page left) files the block in ``chain_tokens`` and starts the next one,
    exactly as the host would: the finished page joins the row's prefix, the next reserved page takes the block's
    K/V, all positions masks, fresh algorithm state, and the sampling key of that block's first step."""
    rows, block = c["tokens"].shape
    used = c["chain_used"]
    slot = (jnp.arange(spec.chain)[None, :] == used[:, None]) & go[:, None]  # [R, C]: where the block is filed
    page_slot = (jnp.arange(row.page_table.shape[1])[None, :] == (row.prefix_len // block)[:, None]) & go[:, None]
    next_page = jnp.take_along_axis(batch.chain_pages, jnp.minimum(used, spec.chain - 1)[:, None], axis=1)[:, 0]
    prefix_len = jnp.where(go, row.prefix_len + block, row.prefix_len)
    fresh_state = spec.algorithm.init_state(rows, block)
    return dict(c, chain_tokens=jnp.where(slot[:, :, None], c["tokens"][:, None, :], c["chain_tokens"]),
                chain_steps=jnp.where(slot, c["steps"][:, None], c["chain_steps"]),
                chain_used=used + go.astype(jnp.int32),
                page_table=jnp.where(page_slot, row.write_page[:, None], row.page_table),
                prefix_len=prefix_len, write_page=jnp.where(go, next_page, row.write_page),
                tokens=jnp.where(go[:, None], spec.mask_id, c["tokens"]),
                immutable=row.immutable & ~go[:, None],
                state=_where_rows(go, fresh_state, c["state"]),
                steps=jnp.where(go, 0, c["steps"]), steps_taken=jnp.where(go, 0, row.steps_taken),
                rng_step=jnp.where(go, prefix_len // block * RNG_STEPS_PER_BLOCK, row.rng_step),
                done=c["done"] & ~go, fresh=c["fresh"] & ~go)


# ----------------------------------------------------------------------------------------------
# The engine's call: one packed array in, one out (see :mod:`dllm_jax.decode.packing`)
# ----------------------------------------------------------------------------------------------

STATE_PREFIX, PENALTY_PREFIX = rows.STATE_PREFIX, rows.PENALTY_PREFIX


@functools.partial(jax.jit, static_argnames=("spec", "layout"), donate_argnames=("kv_pages",))
def denoise_packed(params, kv_pages, packed, *, spec: StepSpec, layout: RowLayout):
    """:func:`denoise` as the engine calls it: every per-row input in ``packed`` (``int32 [R, layout.width]``: the
    :class:`DenoiseBatch` fields by name, ``loop_cap`` in every row, ``state.*``, with penalties ``penalties.*``
    and with chaining ``chain_pages``, ``chain_left``, ``stop_ids``: :mod:`dllm_jax.decode.rows`), every per-row
    result packed by ``rows.result_fields``. Returns ``(kv_pages, packed results, logprobs record or None)``: one array to the device
    and one back per call."""
    batch, state = rows.unpack_inputs(layout.unpack(packed))
    kv_pages, result = denoise(params, kv_pages, batch, state, spec=spec)
    state_row = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in result.state.items()}
    fields = rows.result_fields(state_row, chain=bool(spec.chain))
    out = {f.name: (result.state[f.name[len(STATE_PREFIX):]] if f.name.startswith(STATE_PREFIX)
                    else getattr(result, f.name)) for f in fields}
    dims = rows.Dims(B=spec.block_size, C=spec.chain)
    return kv_pages, rows.layout(fields, dims).pack(out), result.logprobs


def init_kv_pages(cfg: ModelConfig, num_pages: int, block_size: int, dtype=jnp.float32) -> list[Any]:
    """The device page pool, from the family's KV layout: per layer ``(k, v)``, each ``[Hkv, num_pages, B, D]`` of
    that layer (in its own dtype if the layout names one, else ``dtype``), zero-filled."""
    pool = []
    for layer_kv in family_of(cfg).kv_layout(cfg):
        shape = (layer_kv.kv_heads, num_pages, block_size, layer_kv.head_dim)
        kv_dtype = dtype if layer_kv.dtype is None else layer_kv.dtype
        pool.append(tuple(jnp.zeros(shape, kv_dtype) for _ in range(layer_kv.tensors)))
    return pool


def kv_bytes_per_page(cfg: ModelConfig, block_size: int, dtype, *, sliding: bool | None = None) -> int:
    """Bytes of one page (what every layer keeps for ``block_size`` tokens: K and V, or K alone), from the family's
    KV layout. ``sliding``: only the sliding-window layers' share (True) or the others' (False)."""
    return sum(layer_kv.tensors * layer_kv.kv_heads * block_size * layer_kv.head_dim
               * jnp.dtype(dtype if layer_kv.dtype is None else layer_kv.dtype).itemsize
               for layer_kv in family_of(cfg).kv_layout(cfg)
               if sliding is None or (layer_kv.window is not None) == sliding)
