"""The denoise call's per-row inputs and results, each declared once: name, per-row shape, dtype, padding value.

Everything that moves a row derives from these tables: the packed layouts (:mod:`dllm_jax.decode.packing`), the
padding rows of a bucket, the arrays a follower receives into, the device-side :class:`DenoiseBatch` the step reads
and the result the engine unpacks. Adding a per-row field is one entry here (plus the code that produces and the
code that uses its value).

Shapes are written with symbolic sizes, bound per call by :class:`Dims`: ``B`` the block size, ``W`` the
page-table width, ``C`` the chain width, ``H`` the penalty history (the prefix pages plus the block), ``S`` the
chain stop-id table, ``NB`` / ``NS`` the logit-bias and min-new-tokens stop tables, ``G`` the words of a grammar
bitmask (one bit per vocabulary entry).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dllm_jax.cache.pages import TRASH_PAGE
from dllm_jax.decode.packing import RowLayout

STATE_PREFIX = "state."  # packed names of the algorithm state's leaves
PENALTY_PREFIX = "penalties."  # and of the penalty tables
GRAMMAR_PREFIX = "grammar."  # and of the grammar mask
CHAIN_STOP_IDS = 8  # width of the stop-id table of a chaining row (a request with more stop ids does not chain)
MAX_LOGIT_BIAS = 300  # logit-bias entries per row (OpenAI's limit; SamplingParams validates against it)
MAX_MIN_NEW_STOP_IDS = 64  # EOS + stop ids masked by min_new_tokens
MAX_TOP_LOGPROBS = 20  # alternatives per output token (OpenAI's limit); the device computes this many


def is_sampled(temperature, top_k):
    """Whether a row draws its tokens (else it decodes greedily): the one predicate, on scalars or arrays, host or
    device. Temperature 0 and top-k 1 are both greedy."""
    return (temperature > 0) & (top_k != 1)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    shape: tuple[str | int, ...]  # per row, symbolic (see the module's doc)
    dtype: str  # int32 | uint32 | float32 | bool
    pad: Any  # the value of a padding row (decodes nothing, changes nothing)
    doc: str


# Inputs of every denoise call (``loop_cap`` is the call's, repeated in every row).
INPUTS = (
    Field("tokens", ("B",), "int32", 0, "the block's tokens (the mask id where still to decode)"),
    Field("immutable", ("B",), "bool", True, "prompt / committed positions: never rewritten, whatever their value"),
    Field("page_table", ("W",), "int32", TRASH_PAGE, "the row's prefix pages (the trash page beyond)"),
    Field("prefix_len", (), "int32", 0, "cached prefix tokens = absolute offset of the block"),
    Field("write_page", (), "int32", TRASH_PAGE, "the page the block's K/V goes to"),
    Field("steps_taken", (), "int32", 0, "forwards already spent on this block (FDFO carries it)"),
    Field("temperature", (), "float32", 0.0, "0: greedy"),
    Field("top_k", (), "int32", -1, "<= 0: off"),
    Field("top_p", (), "float32", 1.0, "1: off"),
    Field("seed", (), "uint32", 0, "the request's sampling seed"),
    Field("rng_step", (), "int32", 0, "position of this step in the request's generation (folded into the key)"),
    Field("loop_cap", (), "int32", 0, "the most steps of a first-done call (the call's, in every row)"),
)
# With chaining (FDFO / sync calls of few rows): the pages of the row's next blocks, how many of them it may
# start, and the token ids that end its generation (a block holding one of them is the row's last).
CHAIN_INPUTS = (
    Field("chain_pages", ("C",), "int32", 0, "pages for the blocks the row may go on into"),
    Field("chain_left", (), "int32", 0, "how many of them it may start"),
    Field("stop_ids", ("S",), "int32", -1, "ids that end the row's generation (-1 padded)"),
)
# In the penalties variant (decode/penalties.py has the formulas). Every row starts neutral.
PENALTY_INPUTS = (
    Field("history", ("H",), "int32", -1, "the row's real tokens (prompt + committed outputs), -1 beyond"),
    Field("prompt_len", (), "int32", 0, "history[:prompt_len] is the prompt"),
    Field("presence", (), "float32", 0.0, "OpenAI's presence penalty"),
    Field("frequency", (), "float32", 0.0, "OpenAI's frequency penalty"),
    Field("repetition", (), "float32", 1.0, "SGLang's repetition penalty (1: off)"),
    Field("min_new", (), "int32", 0, "EOS and stop ids are masked while fewer outputs are out"),
    Field("bias_ids", ("NB",), "int32", -1, "logit-bias token ids (-1 padded)"),
    Field("bias", ("NB",), "float32", 0.0, "their biases"),
    Field("stop_ids", ("NS",), "int32", -1, "EOS and stop ids masked by min_new"),
    Field("active", (), "bool", False, "any non-neutral value (the others keep the plain figures)"),
)
# In the grammar variant (structured output, dllm_jax/engine/grammar.py): the tokens the row's grammar allows at its
# frontier, the first position of its block still to decode. Every row starts unconstrained.
GRAMMAR_INPUTS = (
    Field("allowed", ("G",), "int32", -1, "bit v % 32 of word v // 32: token v allowed at the frontier"),
    Field("active", (), "bool", False, "the row is constrained (else its computation is the plain step's)"),
    Field("forced", (), "bool", False, "the frontier is decided in this step (its model lately wrote tokens the "
                                       "grammar rejected), else when the algorithm would decide it"),
)
RESULTS = (
    Field("tokens", ("B",), "int32", 0, "the block after the call"),
    Field("done", (), "bool", False, "the block is resolved"),
    Field("steps", (), "int32", 0, "forwards that served the row's block in this call"),
    Field("fresh_kv", (), "bool", False, "the block's page holds the K/V of its final tokens (else: refresh it)"),
    Field("kv_only", (), "int32", 0, "the call's commit forwards that stopped after the K/V (same in every row)"),
)
# With chaining: the blocks a row completed and chained past in this call, oldest first (``tokens`` and the rest
# describe the row's block after them).
CHAIN_RESULTS = (
    Field("chain_blocks", (), "int32", 0, "how many"),
    Field("chain_tokens", ("C", "B"), "int32", 0, "their tokens"),
    Field("chain_steps", ("C",), "int32", 0, "the forwards each took"),
)


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes a call binds the symbolic shapes to."""

    B: int
    W: int = 1
    C: int = 0
    G: int = 1  # grammar bitmask words: ceil(vocab / 32)

    def shape(self, symbolic: tuple) -> tuple[int, ...]:
        sizes = {"B": self.B, "W": self.W, "C": self.C, "H": (self.W + 1) * self.B, "S": CHAIN_STOP_IDS,
                 "NB": MAX_LOGIT_BIAS, "NS": MAX_MIN_NEW_STOP_IDS, "G": self.G}
        return tuple(sizes[d] if isinstance(d, str) else d for d in symbolic)


def _state_fields(state_row: dict) -> tuple[Field, ...]:
    """The algorithm state's leaves (one row of each: ``algorithm.init_state(1, B)`` without its row), padded
    with the fresh state."""
    return tuple(Field(STATE_PREFIX + k, tuple(v.shape), np.dtype(v.dtype).name,
                       None if isinstance(v, jax.ShapeDtypeStruct) else np.asarray(v), "algorithm state")
                 for k, v in sorted(state_row.items()))


def input_fields(dims: Dims, state_row: dict, *, penalties: bool, chain: bool,
                 grammar: bool = False) -> tuple[Field, ...]:
    fields = INPUTS + _state_fields(state_row)
    if chain:
        fields += CHAIN_INPUTS
    if penalties:
        fields += tuple(dataclasses.replace(f, name=PENALTY_PREFIX + f.name) for f in PENALTY_INPUTS)
    if grammar:
        fields += tuple(dataclasses.replace(f, name=GRAMMAR_PREFIX + f.name) for f in GRAMMAR_INPUTS)
    return fields


def result_fields(state_row: dict, *, chain: bool) -> tuple[Field, ...]:
    return RESULTS + _state_fields(state_row) + (CHAIN_RESULTS if chain else ())


def layout(fields: tuple[Field, ...], dims: Dims) -> RowLayout:
    return RowLayout(tuple((f.name, dims.shape(f.shape), f.dtype) for f in fields))


def input_layout(dims: Dims, state_row: dict, *, penalties: bool, chain: bool, grammar: bool = False) -> RowLayout:
    return layout(input_fields(dims, state_row, penalties=penalties, chain=chain, grammar=grammar), dims)


def result_layout(dims: Dims, state_row: dict, *, chain: bool) -> RowLayout:
    return layout(result_fields(state_row, chain=chain), dims)


def padding_rows(fields: tuple[Field, ...], dims: Dims, rows: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """``rows`` padding rows packed by ``layout(fields, dims)`` (read-only), a writable copy of them (what a
    call's rows are written into) and that copy's field views."""
    packed_layout = layout(fields, dims)
    padding, views = packed_layout.empty(rows)
    for f in fields:
        views[f.name][:] = f.pad
    padding.setflags(write=False)
    staging = padding.copy()
    return padding, staging, packed_layout.views(staging)


def reset(views: dict[str, np.ndarray], fields: tuple[Field, ...]) -> None:
    """Write every field's padding value into ``views`` (a staging array reused across calls)."""
    for f in fields:
        views[f.name][:] = f.pad


# ----------------------------------------------------------------------------------------------
# The device-side view: one attribute per input field, derived from the tables
# ----------------------------------------------------------------------------------------------
def _device_dataclass(name: str, fields: tuple[Field, ...], doc: str):
    cls = dataclasses.make_dataclass(name, [(f.name, Any, dataclasses.field(default=None)) for f in fields])
    cls.__doc__ = doc + "\n\n" + "\n".join(f"``{f.name}`` {f.dtype}{list(f.shape)}: {f.doc}" for f in fields)
    return jax.tree_util.register_dataclass(cls)


Penalties = _device_dataclass("Penalties", PENALTY_INPUTS,
                              "One padded batch of penalty inputs (token tables padded with -1, ignored).")
GrammarMask = _device_dataclass("GrammarMask", GRAMMAR_INPUTS, "One padded batch of grammar masks.")
DenoiseBatch = _device_dataclass(
    "DenoiseBatch", INPUTS + CHAIN_INPUTS + (Field("penalties", (), "-", None, "Penalties, in that variant"),
                                             Field("grammar", (), "-", None, "GrammarMask, in that variant")),
    "One padded batch of rows (requests), each holding its current block; ``[R, *shape]`` per field, "
    "``loop_cap`` a scalar.")


def unpack_inputs(values: dict) -> tuple[Any, dict]:
    """Inside the step: the unpacked input fields -> (DenoiseBatch, algorithm state)."""
    state = {k[len(STATE_PREFIX):]: v for k, v in values.items() if k.startswith(STATE_PREFIX)}
    penalties = None
    if any(k.startswith(PENALTY_PREFIX) for k in values):
        penalties = Penalties(**{f.name: values[PENALTY_PREFIX + f.name] for f in PENALTY_INPUTS})
    grammar = None
    if any(k.startswith(GRAMMAR_PREFIX) for k in values):
        grammar = GrammarMask(**{f.name: values[GRAMMAR_PREFIX + f.name] for f in GRAMMAR_INPUTS})
    batch = DenoiseBatch(**{f.name: values[f.name] for f in INPUTS + CHAIN_INPUTS if f.name in values},
                         penalties=penalties, grammar=grammar)
    batch.loop_cap = values["loop_cap"][0]
    return batch, state

