"""What a model family's **block policy** answers to the one :class:`~dllm_jax.engine.scheduler.Scheduler`.

The scheduler owns every request's life (the queue, admission order, the running set, retraction, abort, failures,
events, statistics); a block policy owns what differs by family: how a request's pages are matched, taken and
given back (its KV cache object: the block radix index, or the window-aware index), how a row starts (a block of
masks, or a canvas of noise on the device), which device calls a round needs and what a call's result commits.

The two policies: :class:`~dllm_jax.engine.mask_blocks.MaskBlocks` (SDAR / LLaDA2) and
:class:`~dllm_jax.engine.canvases.Canvases` (DiffusionGemma). A policy's methods the scheduler calls:

* ``attach(scheduler)`` -- once: the policy keeps the scheduler (``running``, ``waiting``, ``stats``, and the
  life-cycle calls ``finish``, ``fail``, ``retract``, ``emit``, ``append_outputs``);
* ``start_admission()`` then ``admit(req) -> Admission`` per waiting request, in order (the scheduler moves it),
  and ``cached_len(req)`` once a request is first admitted (its tokens matched in the cache: ``cached_tokens``);
* ``plan_prefill(reqs, *, retract) -> call | None`` (requests whose real tokens still need encoding; ``retract``
  False while another call runs: only free pages and evictable cache) and ``plan_denoise(reqs) -> call | None``;
  ``idle()`` when decoding requests exist but no call could be planned (a background compile runs);
* ``commit(call, result)``; ``call_requests(call)`` and ``drop_call(call)`` (a failed call: its requests, and the
  pages it reserved for none of them yet);
* ``release(req, keep=)`` -- give back every page the request holds (``keep``: offer its complete pages of real
  tokens to the cache first); ``pool_lost()``, ``reset_cache()``, ``check_pages()``, ``cache_load()``.
"""

from __future__ import annotations

import dataclasses
import enum


class Admission(enum.Enum):
    ADMIT = "admit"  # admitted: the scheduler moves it to the running set (its phase is set)
    SKIP = "skip"  # not now: the next waiting request may be
    WAIT = "wait"  # no room while others run: admission stops for this round


@dataclasses.dataclass(frozen=True)
class Refuse:
    """It can never run (e.g. larger than the pool): the scheduler finishes it with ``abort`` and this message."""

    message: str


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a family's engine can do beyond generating, read by the engine's mixins (never by family name)."""

    rl: bool = True  # weight updates, pause / continue, release / resume memory
    score: bool = True  # Engine.score (needs a mask token)
    # (name, neutral value) of sampling params this family's decoding cannot apply: a request setting one is a
    # ValueError naming it
    refused_params: tuple[tuple[str, object], ...] = ()
    refusal_reason: str = ""
