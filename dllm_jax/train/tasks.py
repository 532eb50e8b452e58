"""The synthetic, deterministic chat corpus the shipped model is trained on.

Every task's answer is fully determined by its prompt and spans several blocks (30-100 tokens with
the project's tokenizer). Items (words, numbers 0-199) are single tokens with a leading space, and
every answer is locally structured: each token follows from its neighbours and the prompt's few
parameters, and the answer's end is visible locally: every task numbers its steps, and it ends
when the step number reaches a small count (at most 20) given in the prompt. That is what a 1-2M-parameter model learns in minutes on a CPU, and
what lets it commit many positions of a block per forward.

* ``count``     -- "Count up 12 steps from 61."          -> "Answer: 1 61 | 2 62 | ... | 12 72"
* ``countdown`` -- "Count down 12 steps from 92."        -> "Answer: 1 92 | 2 91 | ... | 12 81"
* ``evens``     -- "Count by twos 12 steps from 13."     -> "Answer: 1 13 | 2 15 | ... | 12 35"
* ``repeat``    -- "Repeat 8 times: red owl"             -> "Answer: 1 red owl | 2 red owl | ... | 8 red owl"
* ``backwards`` -- "Repeat backwards 8 times: red owl"   -> "Answer: 1 owl red | 2 owl red | ... | 8 owl red"
* ``times``     -- "Times table of 7 from 3 to 12."      -> "Answer: 7 x 3 = 21 | 7 x 4 = 28 | ..."

(Tasks that need long-range content retrieval -- copying, reversing or mapping a list of 30-55
items -- were tried first: a model this size had not started to learn them after 3000 steps,
the classic induction-head plateau. Counting "from 12 to 57" was tried next: the model learned
to count but not to stop, i.e. to match the last number against the prompt's bound among 200
values; it guessed the length instead. See README.md.)

Training examples come from a numpy generator seeded with ``(seed, step)``; the held-out set is the
prefix of a stream drawn with :data:`HELDOUT_SEED`, and training streams skip every prompt of the
first :data:`HELDOUT_POOL` held-out prompts, so held-out prompts are never trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

TASKS = ("count", "countdown", "evens", "repeat", "backwards", "times")
HELDOUT_SEED = 20261202
HELDOUT_POOL = 600  # training never sees any of the first HELDOUT_POOL held-out prompts
MAX_NUMBER = 199
MIN_STEPS, MAX_STEPS = 10, 20  # numbered steps of the counting tasks
ANSWER_PREFIX = "Answer:"

# Short, common English words: each becomes one token " word" in the project's tokenizer.
WORDS = tuple("""
apple bird blue boat book box bread cake car cat chair city cloud coat cold cup dark day desk dog
door duck egg fire fish flag frog gold green hat hill horse house ice king lake lamp leaf light
lion milk moon mouse night nose oak owl paper pen pig pink queen rain red ring river road rock
rose salt sand sea ship shoe sky snow star stone sun table tea tent tiger tree van warm water
wind wolf wood yellow zebra bell drum kite nut pear plum seed song wave glass iron grass corn
""".split())


_ITEM = re.compile(r"\b(\d+|[a-z]+)\b")


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # the user message
    answer: str  # the assistant message (without the end token)


def _join(items) -> str:
    return " ".join(str(x) for x in items)


def _answer(items) -> str:
    return f"{ANSWER_PREFIX} {_join(items)}"


def _steps(rng: np.random.Generator) -> int:
    return int(rng.integers(MIN_STEPS, MAX_STEPS + 1))


def _numbered_items(items) -> str:
    return f"{ANSWER_PREFIX} " + " | ".join(f"{i} {x}" for i, x in enumerate(items, start=1))


def gen_count(rng: np.random.Generator) -> Example:
    steps = _steps(rng)
    lo = int(rng.integers(0, MAX_NUMBER - steps + 2))
    return Example("count", f"Count up {steps} steps from {lo}.", _numbered_items(range(lo, lo + steps)))


def gen_countdown(rng: np.random.Generator) -> Example:
    steps = _steps(rng)
    hi = int(rng.integers(steps - 1, MAX_NUMBER + 1))
    return Example("countdown", f"Count down {steps} steps from {hi}.",
                   _numbered_items(range(hi, hi - steps, -1)))


def gen_evens(rng: np.random.Generator) -> Example:
    steps = _steps(rng)
    lo = int(rng.integers(0, MAX_NUMBER - 2 * (steps - 1) + 1))
    return Example("evens", f"Count by twos {steps} steps from {lo}.",
                   _numbered_items(range(lo, lo + 2 * steps, 2)))


def _phrase_and_times(rng: np.random.Generator) -> tuple[list[str], int]:
    plen = int(rng.integers(2, 6))
    lo_times = -(-30 // (plen + 2))
    hi_times = min(15, 100 // (plen + 2))
    times = int(rng.integers(lo_times, hi_times + 1))
    return [WORDS[i] for i in rng.choice(len(WORDS), plen, replace=False)], times


def _numbered(phrase: list[str], times: int) -> str:
    return f"{ANSWER_PREFIX} " + " | ".join(f"{i} {_join(phrase)}" for i in range(1, times + 1))


def gen_repeat(rng: np.random.Generator) -> Example:
    phrase, times = _phrase_and_times(rng)
    return Example("repeat", f"Repeat {times} times: {_join(phrase)}", _numbered(phrase, times))


def gen_backwards(rng: np.random.Generator) -> Example:
    phrase, times = _phrase_and_times(rng)
    return Example("backwards", f"Repeat backwards {times} times: {_join(phrase)}", _numbered(phrase[::-1], times))


def gen_times(rng: np.random.Generator) -> Example:
    k = int(rng.integers(2, 20))
    top = min(16, MAX_NUMBER // k)
    length = int(rng.integers(6, min(14, top) + 1))
    start = int(rng.integers(1, top - length + 2))
    end = start + length - 1
    lines = " | ".join(f"{k} x {j} = {k * j}" for j in range(start, end + 1))
    return Example("times", f"Times table of {k} from {start} to {end}.", f"{ANSWER_PREFIX} {lines}")


GENERATORS = {
    "count": gen_count, "countdown": gen_countdown, "evens": gen_evens,
    "repeat": gen_repeat, "backwards": gen_backwards, "times": gen_times,
}


def _stream(seed: int, tasks=TASKS):
    """Examples cycling through ``tasks`` in order, from one generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    i = 0
    while True:
        yield GENERATORS[tasks[i % len(tasks)]](rng)
        i += 1


@functools.lru_cache(maxsize=None)
def _heldout_pool() -> tuple[Example, ...]:
    out, seen = [], set()
    stream = _stream(HELDOUT_SEED)
    while len(out) < HELDOUT_POOL:
        ex = next(stream)
        if ex.prompt not in seen:  # the small prompt spaces (count, times) can repeat
            seen.add(ex.prompt)
            out.append(ex)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def heldout_prompts() -> frozenset:
    return frozenset(ex.prompt for ex in _heldout_pool())


def heldout_set(num_prompts: int = 300) -> list[Example]:
    """The first ``num_prompts`` held-out examples (tasks interleaved, so any prefix is balanced)."""
    if not 0 < num_prompts <= HELDOUT_POOL:
        raise ValueError(f"num_prompts must be in 1..{HELDOUT_POOL}, got {num_prompts}")
    return list(_heldout_pool()[:num_prompts])


def training_examples(seed: int, step: int, count: int, tasks=TASKS) -> list[Example]:
    """``count`` training examples for ``step``: a pure function of (seed, step), so resuming is exact."""
    rng = np.random.default_rng([seed, step])
    held = heldout_prompts()
    out = []
    while len(out) < count:
        ex = GENERATORS[tasks[int(rng.integers(0, len(tasks)))]](rng)
        if ex.prompt not in held:
            out.append(ex)
    return out


def tokenizer_corpus(seed: int = 7, samples_per_task: int = 200) -> list[str]:
    """Texts the tokenizer is trained on: examples of every task plus every item once more."""
    rng = np.random.default_rng(seed)
    texts = []
    for task in TASKS:
        for _ in range(samples_per_task):
            ex = GENERATORS[task](rng)
            texts += [ex.prompt, ex.answer]
    texts.append(_join(WORDS))
    texts.append(_join(range(MAX_NUMBER + 1)))
    return texts


def is_correct(example: Example, output_text: str) -> bool:
    """Exact match of the decoded answer, after stripping surrounding whitespace."""
    return output_text.strip() == example.answer.strip()


def near_misses(answer: str, rng: np.random.Generator, count: int = 3) -> list[str]:
    """``count`` distinct wrong answers, each ``answer`` with one item (after "Answer:") changed: a number moved by
    1 or 2, or a word swapped for another of the task's words (multiple-choice and scoring checks)."""
    start = len(ANSWER_PREFIX)
    items = [m for m in _ITEM.finditer(answer, start) if m.group().isdigit() or m.group() in WORDS]
    out: list[str] = []
    while len(out) < count:
        m = items[int(rng.integers(len(items)))]
        old = m.group()
        if old.isdigit():
            new = str(int(old) + int(rng.choice([-2, -1, 1, 2])))
            if not 0 <= int(new) <= MAX_NUMBER:
                continue
        else:
            new = str(rng.choice([w for w in WORDS if w != old]))
        wrong = answer[:m.start()] + new + answer[m.end():]
        if wrong != answer and wrong not in out:
            out.append(wrong)
    return out
