"""The per-canvas adjustment tables of DiffusionGemma's penalties, biases and ``min_new_tokens`` (host side, numpy):
what :mod:`pallas_kernels.renoise_adjust` applies inside the fused vocabulary pass.

For a canvas, every position's soft-capped logit ``z`` of token ``v`` becomes (the formulas of
:mod:`dllm_jax.decode.penalties`, in its order, before the temperature divides):

1. repetition (SGLang / CTRL): if ``v`` occurs in the prompt or the generated tokens, ``z / r`` when ``z > 0``
   else ``z * r``;
2. presence and frequency (OpenAI): ``- presence * (c > 0) - frequency * c``, ``c`` the count of ``v`` in the
   generated tokens;
3. ``+ logit_bias[v]``;
4. ``min_new_tokens``: ``-inf`` for the stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) at the
   positions whose output index (``outputs_before + position``) is below ``min_new_tokens``.

**Generated tokens** are the committed outputs before this canvas: a canvas is re-noised as a whole, so none of its
own positions is decided until it is committed, and its tokens never penalise each other. The table is therefore
fixed for the whole canvas (all its steps) and built once, when the canvas starts.

One entry per adjusted token id (``add`` sums the presence, frequency and bias terms in float64, rounded once to
float32), sorted by id, padded to the call's fixed width with :data:`~pallas_kernels.renoise_adjust.PAD_ID`.
"""

from __future__ import annotations

import numpy as np

from dllm_jax.decode.rows import MAX_LOGIT_BIAS, MAX_MIN_NEW_STOP_IDS
from pallas_kernels.renoise_adjust import PAD_ID

FIELDS = ("ids", "rep", "add", "until")


def table_width(context_tokens: int) -> int:
    """The table width for rows of at most ``context_tokens`` real tokens: every distinct one, the biases and the
    stop ids, as a power of two."""
    need = context_tokens + MAX_LOGIT_BIAS + MAX_MIN_NEW_STOP_IDS
    return 1 << (need - 1).bit_length()


def canvas_entries(*, history, prompt_len: int, canvas_len: int, presence: float = 0.0, frequency: float = 0.0,
                   repetition: float = 1.0, bias=(), stop_ids=(), min_new: int = 0):
    """The entries of one canvas: ``history`` = prompt + the committed outputs before this canvas. Returns
    ``(ids, rep, add, until)`` numpy arrays, sorted by id (only ids some option touches)."""
    history = np.asarray(history, np.int64)
    outputs_before = len(history) - prompt_len
    rep: dict[int, float] = {}
    add: dict[int, float] = {}
    until: dict[int, int] = {}
    if repetition != 1.0:
        for t in np.unique(history):
            rep[int(t)] = repetition
    if presence or frequency:
        ids, counts = np.unique(history[prompt_len:], return_counts=True)
        for t, c in zip(ids.tolist(), counts.tolist()):
            add[t] = add.get(t, 0.0) - presence - frequency * c
    for t, b in bias:
        add[int(t)] = add.get(int(t), 0.0) + float(b)
    masked = min(canvas_len, max(0, min_new - outputs_before))
    if masked:
        for t in stop_ids:
            until[int(t)] = masked
    keys = np.asarray(sorted(set(rep) | set(add) | set(until)), np.int64)
    return (keys.astype(np.int32), np.asarray([rep.get(k, 1.0) for k in keys.tolist()], np.float32),
            np.asarray([add.get(k, 0.0) for k in keys.tolist()], np.float32),
            np.asarray([until.get(k, 0) for k in keys.tolist()], np.int32))


def empty_tables(rows: int, width: int) -> dict[str, np.ndarray]:
    return {"ids": np.full((rows, width), PAD_ID, np.int32), "rep": np.ones((rows, width), np.float32),
            "add": np.zeros((rows, width), np.float32), "until": np.zeros((rows, width), np.int32)}


def put_row(tables: dict[str, np.ndarray], row: int, entries) -> None:
    """Write one row's entries (a ValueError if they do not fit the width)."""
    width = tables["ids"].shape[1]
    n = len(entries[0])
    if n > width:
        raise ValueError(f"adjustment table overflow: {n} entries, room for {width}")
    for name, values in zip(FIELDS, entries):
        tables[name][row, :n] = values
