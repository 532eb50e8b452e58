"""A device call, as the scheduler plans it and the runner runs it: its rows, in host terms, and its result.

One round of the engine is plan -> run -> commit: :meth:`Scheduler.schedule` yields :class:`PrefillCall` /
:class:`DenoiseCall` descriptions (rows, the requests they serve, pages reserved, the loop cap),
:meth:`ModelRunner.run` executes one, and :meth:`Scheduler.process` commits its result (a :class:`DecodeOutput`,
``None`` for a prefill, or :class:`Failed`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from dllm_jax.decode import rows as row_schema
from dllm_jax.decode.rows import MAX_LOGIT_BIAS, MAX_MIN_NEW_STOP_IDS


class RowError(Exception):
    """Packing row ``index`` of a call failed (a value its field's dtype cannot hold, a table overflow): the
    scheduler fails that row's request and runs the others."""

    def __init__(self, index: int, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.index, self.error = index, error


@dataclasses.dataclass
class PrefillRow:
    tokens: list[int]  # C_i complete blocks of real tokens
    prefix_pages: list[int]  # every page before the chunk
    write_pages: list[int]  # C_i pages


# The denoise inputs the runner derives instead of a row carrying them: the page table and the prefix length (from
# ``prefix_pages``) and the call's loop cap. Every other input of :mod:`dllm_jax.decode.rows` is a DecodeRow field
# of the same name, written into a call as it is.
DERIVED_INPUTS = ("page_table", "prefix_len", "loop_cap")
ROW_ATTRIBUTES = tuple(f.name for f in row_schema.INPUTS if f.name not in DERIVED_INPUTS)


@dataclasses.dataclass
class _HostRow:
    """A row's host concepts, which the runner turns into inputs (the prefix pages into ``page_table`` and
    ``prefix_len``, ``penalty`` into the penalty tables, ``chain_pages`` / ``stop_ids`` into the chaining tables)."""

    prefix_pages: list[int] = dataclasses.field(default_factory=list)
    algo_state: dict[str, np.ndarray] | None = None  # None: the algorithm's fresh state
    refresh: bool = False  # a folded block re-encoded for its exact KV (nothing to decode)
    logprobs: int = -1  # -1: none; 0: the written tokens' log probabilities; k > 0: and the top k alternatives
    penalty: "PenaltyRow | None" = None  # None: no penalty or bias
    # The request's grammar (dllm_jax/engine/grammar.py ``RowGrammar``: ``fill_mask``), or UNCONSTRAINED (a row of
    # the grammar variant that nothing constrains: warm-up), or None.
    grammar: Any = None
    # Block chaining (FDFO): pages reserved for the row's next blocks (it may start one per page on the device) and
    # the token ids that end its generation (at most CHAIN_STOP_IDS). Empty: the row does not chain.
    chain_pages: list[int] = dataclasses.field(default_factory=list)
    stop_ids: tuple[int, ...] = ()


# One request's row of a denoise call, as the scheduler describes it: the host concepts above, and a field per
# carried input of the row schema, generated from it (its default the schema's padding value; an array input's
# None: all padding). A refresh or warm-up row names only what differs from padding.
DecodeRow = dataclasses.make_dataclass(
    "DecodeRow", [(f.name, Any, dataclasses.field(default=None if f.shape else f.pad))
                  for f in row_schema.INPUTS if f.name in ROW_ATTRIBUTES], bases=(_HostRow,))
DecodeRow.__module__ = __name__


@dataclasses.dataclass
class PenaltyRow:
    """A row's penalty inputs (see :mod:`dllm_jax.decode.penalties`)."""

    history: list[int]  # prompt + committed outputs
    prompt_len: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_new: int = 0
    bias: tuple[tuple[int, float], ...] = ()
    stop_ids: tuple[int, ...] = ()  # EOS and stop token ids (masked while fewer than min_new tokens are out)


@dataclasses.dataclass
class DecodeOutput:
    tokens: np.ndarray  # [n, B]
    done: np.ndarray  # [n] bool
    steps: np.ndarray  # [n] int
    states: list[dict[str, np.ndarray]]
    fresh_kv: np.ndarray  # [n] bool: False for a block done by folding (its page needs a refresh row)
    # With log probabilities: per position, the figures of the step of this call that last wrote it.
    logprob: np.ndarray | None = None  # [n, B] f32
    top_logprob: np.ndarray | None = None  # [n, B, 20] f32, most likely first
    top_ids: np.ndarray | None = None  # [n, B, 20] int32
    recorded: np.ndarray | None = None  # [n, B] bool
    # Chaining: per row, the blocks completed before ``tokens``' block in this call (``chain_blocks[i]`` of them,
    # oldest first) and the forwards each took. Zero blocks when the call did not chain.
    chain_blocks: np.ndarray | None = None  # [n] int
    chain_tokens: np.ndarray | None = None  # [n, C, B]
    chain_steps: np.ndarray | None = None  # [n, C]
    forwards: np.ndarray | None = None  # [n]: every forward that served the row in this call (chained blocks too)


@dataclasses.dataclass
class PrefillCall:
    """Encode chunks of complete blocks: one row per request, ``pages[i]`` the pages ``reqs[i]``'s chunk fills."""

    reqs: list
    pages: list[list[int]]
    rows: list[PrefillRow]


@dataclasses.dataclass
class DenoiseCall:
    """Denoise steps over the decoding requests that can run now (``reqs``) after the refresh rows of folded
    commits (``refresh``); ``chain_pages[id(req)]``: pages reserved for the blocks ``req`` may chain into."""

    refresh: list
    reqs: list
    rows: list[DecodeRow]
    loop_cap: int
    chain_pages: dict[int, list[int]]

    @property
    def all_reqs(self) -> list:
        return self.refresh + self.reqs  # in row order


@dataclasses.dataclass(frozen=True)
class Pending:
    """A dispatched device call (``runner.dispatch``): ``collect`` reads and unpacks its results (None: a call whose
    result is nothing, e.g. a prefill; it ran in line). ``in_flight``: the device may still be running it."""

    collect: Callable[[], Any] | None

    @property
    def in_flight(self) -> bool:
        return self.collect is not None


@dataclasses.dataclass
class Failed:
    """The result of a call that raised."""

    error: BaseException


class _Unconstrained:
    forced = False

    @staticmethod
    def fill_mask(out) -> bool:
        return False


UNCONSTRAINED = _Unconstrained()


def fill_grammar(rows: list[DecodeRow], fields: dict[str, np.ndarray]) -> None:
    """Write the grammar masks of a call into its staging ``fields`` (``grammar.allowed`` [R, G] int32,
    ``grammar.active`` / ``grammar.forced`` [R]): each constrained row's frontier mask, computed here, on the host,
    right before the call (it depends on what the row's last call decided; a row whose frontier did not move gets
    its last one again) and whether its frontier is forced; every other row all-allowed and inactive."""
    prefix = row_schema.GRAMMAR_PREFIX
    out = {k[len(prefix):]: v for k, v in fields.items() if k.startswith(prefix)}
    row_schema.reset(out, row_schema.GRAMMAR_INPUTS)
    for i, r in enumerate(rows):
        if r.grammar is None:
            continue
        try:
            out["active"][i] = r.grammar.fill_mask(out["allowed"][i])
            out["forced"][i] = r.grammar.forced
        except Exception as e:
            raise RowError(i, e) from e


def fill_penalties(rows: list[DecodeRow], out: dict[str, np.ndarray]) -> None:
    """Write the :class:`~dllm_jax.decode.penalties.Penalties` tables of a call into ``out`` (zeroed views: every
    row starts neutral, as rows without a penalty and padding rows stay). The history is as wide as the page-table
    bucket allows (prefix pages plus the block), the bias and stop tables have the fixed widths the sampling params
    are validated against: no new shapes."""
    history_len = out["history"].shape[1]
    row_schema.reset(out, row_schema.PENALTY_INPUTS)
    for i, r in enumerate(rows):
        p = r.penalty
        if p is None:
            continue
        try:
            _fill_penalty_row(out, i, p, history_len)
        except Exception as e:
            raise RowError(i, e) from e


def _fill_penalty_row(out: dict[str, np.ndarray], i: int, p: "PenaltyRow", history_len: int) -> None:
    """Row ``i`` of the penalty tables (a value that does not fit its table or dtype raises)."""
    if len(p.history) > history_len or len(p.bias) > MAX_LOGIT_BIAS or len(p.stop_ids) > MAX_MIN_NEW_STOP_IDS:
        raise ValueError(f"penalty tables overflow: {len(p.history)} history tokens (room for {history_len}), "
                         f"{len(p.bias)} biases, {len(p.stop_ids)} stop ids")
    out["history"][i, :len(p.history)] = p.history
    out["prompt_len"][i] = p.prompt_len
    out["presence"][i], out["frequency"][i], out["repetition"][i] = p.presence, p.frequency, p.repetition
    out["min_new"][i] = p.min_new
    if p.bias:
        out["bias_ids"][i, :len(p.bias)] = [t for t, _ in p.bias]
        out["bias"][i, :len(p.bias)] = [b for _, b in p.bias]
    out["stop_ids"][i, :len(p.stop_ids)] = p.stop_ids
    out["active"][i] = bool(p.presence or p.frequency or p.repetition != 1.0 or p.min_new or p.bias)
