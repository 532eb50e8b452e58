"""The synthetic, deterministic chat corpus the shipped model is trained on.

Every task's answer is fully determined by its prompt and spans several blocks (roughly 30-100
tokens with the project's tokenizer). Items (words, numbers 0-199) are single tokens with a leading
space, so a model can place each answer token by position and fill many positions per forward.

* ``copy``     -- "Copy the list: a b c"                 -> "Answer: a b c"
* ``reverse``  -- "Reverse the list: a b c"              -> "Answer: c b a"
* ``count``    -- "Count from 12 to 57." / "Count down from 57 to 12."
* ``repeat``   -- "Repeat 7 times: red fox"              -> "Answer: red fox | red fox | ..."
* ``add_one``  -- "Add one to each number: 4 17 99"      -> "Answer: 5 18 100"
* ``times``    -- "Times table of 7 from 3 to 12."       -> "Answer: 7 x 3 = 21 | 7 x 4 = 28 | ..."

Training examples come from a numpy generator seeded with ``(seed, step)``; the held-out set is the
prefix of a stream drawn with :data:`HELDOUT_SEED`, and training streams skip every prompt of the
first :data:`HELDOUT_POOL` held-out prompts, so held-out prompts are never trained on.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

TASKS = ("copy", "reverse", "count", "repeat", "add_one", "times")
HELDOUT_SEED = 20261202
HELDOUT_POOL = 2000  # training never sees any of the first HELDOUT_POOL held-out prompts
MAX_NUMBER = 199
ANSWER_PREFIX = "Answer:"

# Short, common English words: each becomes one token " word" in the project's tokenizer.
WORDS = tuple("""
apple bird blue boat book box bread cake car cat chair city cloud coat cold cup dark day desk dog
door duck egg fire fish flag frog gold green hat hill horse house ice king lake lamp leaf light
lion milk moon mouse night nose oak owl paper pen pig pink queen rain red ring river road rock
rose salt sand sea ship shoe sky snow star stone sun table tea tent tiger tree van warm water
wind wolf wood yellow zebra bell drum kite nut pear plum seed song wave glass iron grass corn
""".split())


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # the user message
    answer: str  # the assistant message (without the end token)


def _join(items) -> str:
    return " ".join(str(x) for x in items)


def _answer(items) -> str:
    return f"{ANSWER_PREFIX} {_join(items)}"


def _item_list(rng: np.random.Generator, n: int) -> list:
    if rng.random() < 0.5:
        return [WORDS[i] for i in rng.integers(0, len(WORDS), n)]
    return [int(x) for x in rng.integers(0, MAX_NUMBER + 1, n)]


def gen_copy(rng: np.random.Generator) -> Example:
    items = _item_list(rng, int(rng.integers(30, 61)))
    return Example("copy", f"Copy the list: {_join(items)}", _answer(items))


def gen_reverse(rng: np.random.Generator) -> Example:
    items = _item_list(rng, int(rng.integers(30, 61)))
    return Example("reverse", f"Reverse the list: {_join(items)}", _answer(items[::-1]))


def gen_count(rng: np.random.Generator) -> Example:
    length = int(rng.integers(30, 91))
    lo = int(rng.integers(0, MAX_NUMBER - length + 2))
    hi = lo + length - 1
    if rng.random() < 0.5:
        return Example("count", f"Count from {lo} to {hi}.", _answer(range(lo, hi + 1)))
    return Example("count", f"Count down from {hi} to {lo}.", _answer(range(hi, lo - 1, -1)))


def gen_repeat(rng: np.random.Generator) -> Example:
    plen = int(rng.integers(2, 6))
    lo_times = max(2, -(-30 // (plen + 1)))
    hi_times = min(15, 100 // (plen + 1))
    times = int(rng.integers(lo_times, hi_times + 1))
    phrase = _join(WORDS[i] for i in rng.integers(0, len(WORDS), plen))
    return Example("repeat", f"Repeat {times} times: {phrase}", f"{ANSWER_PREFIX} " + " | ".join([phrase] * times))


def gen_add_one(rng: np.random.Generator) -> Example:
    nums = [int(x) for x in rng.integers(0, MAX_NUMBER, int(rng.integers(30, 61)))]
    return Example("add_one", f"Add one to each number: {_join(nums)}", _answer(x + 1 for x in nums))


def gen_times(rng: np.random.Generator) -> Example:
    k = int(rng.integers(2, 13))
    top = min(16, MAX_NUMBER // k)
    length = int(rng.integers(6, min(14, top) + 1))
    start = int(rng.integers(1, top - length + 2))
    end = start + length - 1
    lines = " | ".join(f"{k} x {j} = {k * j}" for j in range(start, end + 1))
    return Example("times", f"Times table of {k} from {start} to {end}.", f"{ANSWER_PREFIX} {lines}")


GENERATORS = {
    "copy": gen_copy, "reverse": gen_reverse, "count": gen_count,
    "repeat": gen_repeat, "add_one": gen_add_one, "times": gen_times,
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
