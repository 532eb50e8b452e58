"""Write ``dllm_mc.jsonl``: a multiple-choice task over the shipped model's held-out prompts, for lm-eval.

Each doc is one held-out example of :mod:`dllm_jax.train.tasks` (never trained on): ``prompt`` is its user message
rendered with the shipped model's chat template (the one it was trained on, generation prompt included), ``choices``
are the correct answer and three near misses (one item changed: a number moved by 1 or 2, or a word swapped for
another of the task's words), shuffled; ``label`` is the correct one's index. Deterministic (seeded).

``context`` and ``continuations`` are what the lm-eval task scores: the prompt with the answers' common start
(``Answer:``) and the choices after it. lm-eval moves a context's trailing whitespace into the continuation
(``TemplateLM._encode_pair``), so with ``prompt`` (which ends in the template's ``"assistant\n"``) as the context
every choice would be scored with that newline first, a token the model was never trained to predict (prompt
tokens carry no loss): the same -12 to -15 nats added to each choice. Ending the context in ``Answer:`` keeps the
newline in the context, where the model saw it in training.

    python bench/lm_eval_task/make_dataset.py [--num-docs 50] [--out bench/lm_eval_task/dllm_mc.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from dllm_jax.assets import DEFAULT_MODEL_PATH
from dllm_jax.train import tasks

HERE = os.path.dirname(os.path.abspath(__file__))
ANSWER_START = "Answer:"  # every answer of dllm_jax.train.tasks starts so


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-docs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "dllm_mc.jsonl"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    rng = np.random.default_rng(args.seed)
    with open(args.out, "w") as f:
        for i, ex in enumerate(tasks.heldout_set(args.num_docs)):
            prompt = tok.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                             add_generation_prompt=True)
            choices = [ex.answer] + tasks.near_misses(ex.answer, rng)
            order = rng.permutation(len(choices))
            doc = {"id": i, "task": ex.task, "prompt": prompt, "choices": [choices[j] for j in order],
                   "label": int(np.flatnonzero(order == 0)[0])}
            assert all(c.startswith(ANSWER_START) for c in doc["choices"]), doc
            doc["context"] = prompt + ANSWER_START
            doc["continuations"] = [c[len(ANSWER_START):] for c in doc["choices"]]
            f.write(json.dumps(doc) + "\n")
    print(f"wrote {args.num_docs} docs to {args.out}")


if __name__ == "__main__":
    main()
