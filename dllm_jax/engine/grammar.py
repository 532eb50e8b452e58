"""Structured output: a request's grammar (a JSON schema, a regex or an EBNF), compiled by llguidance, and its
state as the request's blocks are decided.

**The engine: llguidance** (``python -m bench.grammar_engines``, measured on the shipped tokenizer and on a trained
32k byte-level BPE; bench/RESULTS.md has the table). Per grammar, llguidance compiles in under 1 ms where xgrammar
takes 5 / 54 ms and outlines-core 31 / 136 ms (a JSON schema, at 768 / 32k tokens): that is paid on the request
path, per request. It checks a run of ``k`` decided tokens in one call (``validate_tokens``, 4-7 us for 32) where
xgrammar accepts token by token (17-28 us with the rollback); outlines-core walks a DFA (2 us) but compiles only
regular languages (no EBNF, a JSON schema via a regex that grows with nesting). Its next-token mask costs 10-20 us
against xgrammar's 1-6 us, paid per constrained row and step: 16 rows cost ~0.3 ms of host time a step, measured
against the step by ``python -m bench.structured``. It reads JSON schema, regex and Lark / GBNF grammars and says
why one does not compile (the 400's reason).

**How a block decoded out of order stays valid by construction** (a left-to-right engine cannot check a block
with holes). A constrained row's *frontier* (its first undecided position; every position before it is decided
and checked) takes its token from the grammar's mask given the decided prefix (the device applies the packed
bitmask, :mod:`dllm_jax.decode.grammar_mask`). With ``EngineConfig.grammar_frontier`` "forced" (the default) the
algorithm decides it at every step, so each step advances it by a token from the mask and the call ends after
that step. With "model" its confidence is that of the masked distribution and the algorithm decides it as it
decides any position, in its own order; the device loop goes on until some row decides its frontier (the mask
holds until then), and the frontier is forced once the row decided 3 positions past it, or for the rest of the
block once the model wrote a token the grammar rejected. On the shipped model, which decodes out of order and
knows no JSON, "forced" gives the most tokens per forward and the loop under "model" rarely runs past a step
(``python -m bench.structured --grammar-frontier model``; bench/RESULTS.md).
Other positions commit as the algorithm decides; after the call the host checks the decided run from the frontier
with ``validate_tokens`` and takes back its first invalid token and everything after it
(:meth:`RowGrammar.check_block`). A token decided past an undecided position stays *provisional*: unchecked, the
block not committed, until the run reaches and checks it (then it stays or goes back). So every committed token is
a valid continuation, the frontier's token always is, EOS commits only where the grammar accepts, and the mask id
is never a candidate. Keeping provisional tokens keeps the model's parallel, out-of-order commits wherever they
turn out valid (tokens per forward under a constraint the model's own text meets: ``python -m bench.structured``).
Text the grammar forces (a schema's keys and punctuation) is written into the block by the host (llguidance's
fast-forward tokens) without waiting for the model. A row whose frontier did not move in a call gets its last mask
again (the matcher state unchanged), not recomputed. A DINGO-style
automaton over the whole block would constrain every position of the block in one step, but only for regular
languages (no EBNF, no recursive schemas) and with a per-step dynamic program over ``[B, states, V]`` on the
device; the frontier rule covers every grammar llguidance reads, keeps parallel commits that turn out valid, and
costs the device one gather and one head row per constrained row.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np

from dllm_jax.engine.sampling import GRAMMAR_FIELDS  # noqa: F401 (the fields a GrammarSpec's kind names)


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What constrains a request: ``kind`` one of :data:`GRAMMAR_FIELDS` (``json_schema``: its text), and the
    field that carried it (named by errors)."""

    kind: str
    text: str
    field: str


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec`` (a ValueError naming the field if it cannot be read at all)."""
    import llguidance

    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec.field}: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{spec.field}: a JSON schema must be an object, got {type(schema).__name__}")
        if schema is False:
            raise ValueError(f"{spec.field}: the schema false accepts no value")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema if isinstance(schema, dict) else {}, defaults={"whitespace_flexible": False})
        except Exception as e:
            raise ValueError(f"{spec.field}: {e}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    try:
        return llguidance.grammar_from("ebnf", spec.text)
    except Exception as e:
        raise ValueError(f"{spec.field}: {e}") from None


class GrammarCompiler:
    """An engine's grammar compiler: the tokenizer as llguidance sees it (built once, ~10 ms for the shipped
    model), the bitmask width, and :meth:`compile` (a ValueError naming the field and llguidance's reason for a
    grammar it cannot use)."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: tuple[int, ...], mask_id: int | None,
                 forced: bool = True):
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        self.forced = forced  # (EngineConfig.grammar_frontier: every row's frontier forced at every step)
        self.words = (vocab_size + 31) // 32
        self.mask_id = mask_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids) or None)
        # Tokens no grammar may take: the mask id, and ids beyond the tokenizer's (the embedding's padding rows).
        keep = np.ones((self.words * 32,), np.bool_)
        keep[len(tokenizer):] = False
        keep[list(eos_token_ids)] = True  # (EOS is governed by the grammar's own bits)
        if mask_id is not None:  # (a canvas model has none)
            keep[mask_id] = False
        self.allowed_ever = np.packbits(keep, bitorder="little").view("<i4").astype(np.int32)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> "RowGrammar":
        import llguidance

        grammar = grammar_text(spec)
        with self._lock:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{spec.field}: {matcher.get_error()}")
        return RowGrammar(matcher, self)


class RowGrammar:
    """One request's grammar state. The matcher has consumed the committed outputs plus the checked run of the
    current block (``block_run``), never anything unchecked."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        self.matcher = matcher
        self.compiler = compiler
        self.block_run: list[int] = []
        self.stopped = False  # the grammar consumed EOS: the rest of the answer is cut at it
        self.mask_seconds = 0.0  # host time spent in masks and checks (bench.structured reads it)
        self.masks_computed = self.masks_reused = 0
        # The last mask and the matcher state it was computed in (``_state``: bumped at every consume / rollback):
        # a row whose frontier did not move in a call (the device loop stopped for another row's) gets the same
        # mask again without computing it.
        self._state = 0
        # Whether the device decides the frontier in the next step whatever its confidence (see
        # grammar_mask.py): always with grammar_frontier "forced"; else from a check that took back a token the
        # model decided (its text breaks the grammar) to the end of the block. Until then the algorithm decides
        # the frontier by its confidence under the mask, in its own order, and the device loop goes on.
        self.forced = compiler.forced
        self._mask: tuple[int, np.ndarray] | None = None

    # -- blocks ---------------------------------------------------------------------------------
    def new_block(self) -> None:
        """A block starts (or restarts after a retraction): what the matcher consumed of an uncommitted block goes."""
        if self.block_run:
            self.matcher.rollback(len(self.block_run))
            self.block_run = []
            self._state += 1
        self.stopped = False  # (committed outputs hold no EOS: it would have ended the request)
        self.forced = self.compiler.forced

    def block_committed(self) -> None:
        self.block_run = []
        self.forced = self.compiler.forced

    def check_block(self, tokens: np.ndarray, immutable: np.ndarray, mask_id: int) -> tuple[np.ndarray, bool]:
        """``tokens``: the row's block after a call. Returns (the block with the decided run from its start checked:
        the first token the grammar rejects and everything after it taken back to the mask id, the text the grammar
        forces written in at the frontier; whether anything was taken back). Tokens past the first undecided
        position stay as they are, provisional. Once the run took an EOS (:attr:`stopped`) the rest is left alone
        (the answer ends at the EOS)."""
        import time

        t0 = time.perf_counter()
        tokens = np.array(tokens, np.int32)
        gen = tokens[int(np.count_nonzero(immutable)):]  # (a view: written through)
        common = 0
        for a, b in zip(self.block_run, gen.tolist()):
            if a != b:
                break
            common += 1
        if common < len(self.block_run):  # a checked token was rewritten: undo from there
            self._state += 1
            self.matcher.rollback(len(self.block_run) - common)
            self.block_run = self.block_run[:common]
            self.stopped = self._ate_eos()
        taken_back = False
        while not self.stopped:
            at = len(self.block_run)
            holes = np.flatnonzero(gen[at:] == mask_id)
            run = gen[at:at + (int(holes[0]) if holes.size else gen.size - at)].tolist()
            valid = self.matcher.validate_tokens(run) if run else 0
            if valid:
                self._state += 1
                self._advanced(self.matcher.consume_tokens(run[:valid]))
                self.block_run += run[:valid]
            # (validate_tokens counts no EOS once the grammar is complete: an EOS where it accepts is taken here)
            if valid < len(run) and run[valid] in self.compiler.eos_token_ids and self.matcher.is_accepting():
                self._state += 1
                self._advanced(self.matcher.consume_token(run[valid]))
                self.block_run.append(run[valid])
                self.stopped = True
                break
            if valid < len(run):  # rejected: it and everything after it go back
                gen[at + valid:] = mask_id
                taken_back = True
            if not self._fast_forward(gen, len(self.block_run)):
                break  # (else: check what follows the forced text)
        self.forced |= taken_back
        self.mask_seconds += time.perf_counter() - t0
        return tokens, taken_back

    def _advanced(self, ok: bool) -> None:
        """The matcher's answer to consuming tokens already checked to be allowed: a refusal is a bug, raised as one
        (not an ``assert`` around the call, which ``python -O`` would drop with the call)."""
        if not ok:
            raise RuntimeError(f"grammar: {self.matcher.get_error()}")

    def _ate_eos(self) -> bool:
        return bool(self.block_run) and self.block_run[-1] in self.compiler.eos_token_ids

    def _fast_forward(self, gen: np.ndarray, at: int) -> int:
        """Write the tokens the grammar forces from ``at`` (a schema's fixed text) into the block (over masks or
        provisional tokens). Returns how many it wrote."""
        wrote = 0
        while at < gen.size:
            forced = self.matcher.compute_ff_tokens()[:gen.size - at]
            if not forced:
                break
            self._state += 1
            self._advanced(self.matcher.consume_tokens(forced))
            gen[at:at + len(forced)] = forced
            self.block_run += forced
            at += len(forced)
            wrote += len(forced)
        return wrote

    # -- canvases (DiffusionGemma) ----------------------------------------------------------------
    def accept_canvas(self, canvas: list[int], alternatives: np.ndarray | None) -> list[int]:
        """The tokens to commit of a finished canvas (the argmax of its last step): its longest valid prefix (up to
        and with an EOS where the grammar accepts), then, where it went wrong, the most likely of that position's
        recorded alternatives (``alternatives [C, k]``, most likely first) the grammar allows, else an allowed
        token (EOS where it accepts, else the text it forces, else the lowest allowed id). At least one token, every
        one checked; what follows is dropped and the next canvas starts after it."""
        import time

        t0 = time.perf_counter()
        m = self.matcher
        self._state += 1
        valid = m.validate_tokens(canvas)
        if valid:
            self._advanced(m.consume_tokens(canvas[:valid]))
        out = list(canvas[:valid])
        if valid < len(canvas):
            eos = self.compiler.eos_token_ids
            if canvas[valid] in eos and m.is_accepting():
                pick = canvas[valid]
            else:
                options = [int(t) for t in alternatives[valid]] if alternatives is not None else []
                pick = next((t for t in options if t != self.compiler.mask_id and (
                    (t in eos and m.is_accepting()) or (t not in eos and m.validate_tokens([t]) == 1))), None)
                if pick is None:
                    pick = self._any_allowed()
            self._advanced(m.consume_token(pick))
            self._state += 1
            out.append(pick)
        self.mask_seconds += time.perf_counter() - t0
        return out

    def _any_allowed(self) -> int:
        if self.matcher.is_accepting():
            return self.compiler.eos_token_ids[0]
        forced = self.matcher.compute_ff_tokens()
        if forced:
            return forced[0]
        words = np.zeros((self.compiler.words,), np.int32)
        self.fill_mask(words)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return int(np.flatnonzero(bits)[0])

    # -- the device's input ---------------------------------------------------------------------
    def fill_mask(self, out: np.ndarray) -> bool:
        """Write the frontier's bitmask (int32 words, bit ``v % 32`` of word ``v // 32``: token ``v`` allowed)
        into ``out``. Returns whether the row is constrained at all (False once EOS was accepted)."""
        import time

        if self.stopped:
            return False
        t0 = time.perf_counter()
        if self._mask is not None and self._mask[0] == self._state:
            out[:] = self._mask[1]
            self.masks_reused += 1
        else:
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            if self.matcher.is_error():
                raise RuntimeError(f"grammar: {self.matcher.get_error()}")
            out &= self.compiler.allowed_ever
            self._mask = (self._state, out.copy())
            self.masks_computed += 1
        self.mask_seconds += time.perf_counter() - t0
        return True
