"""Exact-match evaluation of a generator on the held-out synthetic tasks (``dllm-jax eval``).

``evaluate(generate_fn, ...)`` formats every held-out prompt with the model's chat template, calls
``generate_fn(prompts_as_token_id_lists, block_size, threshold) -> [(output_ids, forward_passes)]``
once for the whole set, decodes each output (special tokens skipped) and compares it, stripped, with
the expected answer. ``tokens_per_forward`` is completion tokens over forward passes, both summed over
the prompts (a completion's EOS token counts; tokens after it do not).
``format_report(result)`` renders a per-task table whose last line is one JSON object.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from dllm_jax.train import tasks

GenerateFn = Callable[[list[list[int]], int, float], Sequence[tuple[Sequence[int], int]]]


def load_default_tokenizer(model_path: str | None = None):
    from transformers import AutoTokenizer

    if model_path is None:
        from dllm_jax.assets import DEFAULT_MODEL_PATH

        model_path = DEFAULT_MODEL_PATH
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def prompt_ids(tokenizer, examples: list[tasks.Example]) -> list[list[int]]:
    out = []
    for ex in examples:
        text = tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def evaluate(generate_fn: GenerateFn, *, num_prompts: int = 300, block_size: int = 32, threshold: float = 0.9,
             tokenizer=None, model_path: str | None = None, max_failures: int = 5) -> dict[str, Any]:
    """Run ``generate_fn`` on the first ``num_prompts`` held-out prompts and score the answers."""
    if tokenizer is None:
        tokenizer = load_default_tokenizer(model_path)
    examples = tasks.heldout_set(num_prompts)
    prompts = prompt_ids(tokenizer, examples)
    outputs = list(generate_fn(prompts, block_size, threshold))
    if len(outputs) != len(examples):
        raise ValueError(f"generate_fn returned {len(outputs)} results for {len(examples)} prompts")
    per_task: dict[str, dict[str, Any]] = {}
    failures = []
    total_tokens = total_forwards = total_correct = 0
    correct = []  # per prompt, in held-out order (paired comparisons of two models)
    for ex, (ids, forwards) in zip(examples, outputs):
        ids = [int(t) for t in ids]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ok = tasks.is_correct(ex, text)
        row = per_task.setdefault(ex.task, {"num_prompts": 0, "correct": 0, "completion_tokens": 0,
                                            "forward_passes": 0})
        row["num_prompts"] += 1
        row["correct"] += int(ok)
        row["completion_tokens"] += len(ids)
        row["forward_passes"] += int(forwards)
        total_correct += int(ok)
        correct.append(int(ok))
        total_tokens += len(ids)
        total_forwards += int(forwards)
        if not ok and len(failures) < max_failures:
            failures.append({"task": ex.task, "prompt": ex.prompt, "expected": ex.answer, "got": text})
    for row in per_task.values():
        row["accuracy"] = row["correct"] / row["num_prompts"]
        row["tokens_per_forward"] = row["completion_tokens"] / max(row["forward_passes"], 1)
    return {
        "accuracy": total_correct / len(examples),
        "tokens_per_forward": total_tokens / max(total_forwards, 1),
        "num_prompts": len(examples),
        "correct": total_correct,
        "completion_tokens": total_tokens,
        "forward_passes": total_forwards,
        "block_size": int(block_size),
        "threshold": float(threshold),
        "per_task": {t: per_task[t] for t in tasks.TASKS if t in per_task},
        "failures": failures,
        "correct_per_prompt": correct,
    }


def format_report(result: dict[str, Any]) -> str:
    """The per-task table, the first failures, and as the last line one JSON object (the summary)."""
    lines = [f"held-out exact match, block size {result['block_size']}, LowConfidence threshold {result['threshold']}",
             f"{'task':<10} {'prompts':>7} {'accuracy':>9} {'tokens':>7} {'forwards':>8} {'tok/fwd':>7}"]
    for task, r in result["per_task"].items():
        lines.append(f"{task:<10} {r['num_prompts']:>7d} {r['accuracy']:>9.3f} {r['completion_tokens']:>7d} "
                     f"{r['forward_passes']:>8d} {r['tokens_per_forward']:>7.2f}")
    lines.append(f"{'all':<10} {result['num_prompts']:>7d} {result['accuracy']:>9.3f} {result['completion_tokens']:>7d} "
                 f"{result['forward_passes']:>8d} {result['tokens_per_forward']:>7.2f}")
    for f in result.get("failures", []):
        lines.append(f"FAIL [{f['task']}] {f['prompt']!r}\n  expected: {f['expected']!r}\n  got:      {f['got']!r}")
    summary = {k: result[k] for k in ("accuracy", "tokens_per_forward", "num_prompts", "correct",
                                      "completion_tokens", "forward_passes", "block_size", "threshold")}
    summary["per_task_accuracy"] = {t: round(r["accuracy"], 4) for t, r in result["per_task"].items()}
    lines.append(json.dumps(summary))
    return "\n".join(lines)
