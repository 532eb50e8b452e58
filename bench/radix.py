"""Host-side cost of the block radix index: match and insert of a 4,096-token prompt.

Builds a tree of 10,000 blocks (B = 32) out of prompts that share a few system-prompt prefixes,
then times each operation call by call and prints median / p99 in microseconds. The engine does
one match per admitted request and one insert per committed block (or per finish), so these
figures bound the per-request host overhead of prefix caching.

    python -m bench.radix [--blocks 10000] [--prompt-tokens 4096] [--reps 1000] [--out bench_out/radix.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

from dllm_jax.cache.pages import PageAllocator
from dllm_jax.cache.radix import BlockRadixIndex

VOCAB = 151_000


def percentile(values_ns: list[int], q: float) -> float:
    ordered = sorted(values_ns)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index] / 1000


def summarize(values_ns: list[int]) -> dict:
    return {
        "median_us": round(statistics.median(values_ns) / 1000, 2),
        "p90_us": round(percentile(values_ns, 90), 2),
        "p99_us": round(percentile(values_ns, 99), 2),
        "min_us": round(min(values_ns) / 1000, 2),
        "n": len(values_ns),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=10_000, help="blocks in the tree before timing")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=1000, help="timed calls per hit scenario")
    parser.add_argument("--miss-reps", type=int, default=300, help="timed calls per miss scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out/radix.json")
    args = parser.parse_args(argv)

    block, prompt_len = args.block_size, args.prompt_tokens
    prompt_blocks = prompt_len // block
    rng = random.Random(args.seed)

    def random_tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    # Pool: the tree, plus fresh pages for every miss insert and duplicate insert.
    num_pages = 1 + args.blocks + prompt_blocks * (2 * args.miss_reps + 16)
    alloc = PageAllocator(num_pages)
    tree = BlockRadixIndex(block, alloc)

    # Build: prompts of prompt_len tokens, each starting with one of 8 shared system prefixes
    # (a quarter of the prompt), until the tree holds exactly args.blocks blocks.
    system_prefixes = [random_tokens(prompt_len // 4) for _ in range(8)]
    cached_prompts: list[list[int]] = []
    while tree.num_nodes < args.blocks:
        prompt = rng.choice(system_prefixes) + random_tokens(prompt_len - prompt_len // 4)
        hit = tree.match(prompt, len(prompt))
        room = args.blocks - tree.num_nodes  # new blocks we may still add
        keep_blocks = min(prompt_blocks, len(hit.pages) + room)
        prompt = prompt[: keep_blocks * block]
        pages = hit.pages + alloc.alloc(keep_blocks - len(hit.pages))
        tree.insert(prompt, pages)
        if keep_blocks == prompt_blocks:
            cached_prompts.append(prompt)
    assert tree.num_nodes == args.blocks
    tree.check_invariants()

    hit_prompt = cached_prompts[len(cached_prompts) // 2]
    hit_pages = tree.match(hit_prompt, len(hit_prompt)).pages
    assert len(hit_pages) == prompt_blocks

    timer = time.perf_counter_ns
    results: dict[str, dict] = {}

    def timed(name: str, reps: int, setup, call, check=None) -> None:
        """Time `call(setup())` reps times (setup untimed), after a few warm-up calls."""
        gc.collect()
        samples = []
        for i in range(reps + 5):
            arg = setup()
            t0 = timer()
            out = call(arg)
            t1 = timer()
            if check is not None:
                check(out)
            if i >= 5:
                samples.append(t1 - t0)
        results[name] = summarize(samples)

    # -- hits: the prompt is fully cached --------------------------------------------------------
    def check_full_hit(res):
        assert res.matched_len == prompt_blocks * block

    timed("match, hit (128 blocks)", args.reps, lambda: hit_prompt,
          lambda p: tree.match(p, len(p)), check_full_hit)
    timed("insert, hit (same pages)", args.reps, lambda: hit_pages,
          lambda pages: tree.insert(hit_prompt, pages), lambda out: out == hit_pages or sys.exit("bad insert"))
    timed("match + insert, hit", args.reps, lambda: hit_prompt,
          lambda p: tree.insert(p, tree.match(p, len(p)).pages))
    timed("insert, duplicate pages (frees 128)", args.miss_reps, lambda: alloc.alloc(prompt_blocks),
          lambda pages: tree.insert(hit_prompt, pages), lambda out: out == hit_pages or sys.exit("bad dup insert"))

    # -- partial hit: shared system prefix (32 blocks) then a new tail -------------------------
    partial_prompt = system_prefixes[0] + random_tokens(prompt_len - prompt_len // 4)
    timed("match, partial hit (32 of 128 blocks)", args.reps, lambda: partial_prompt,
          lambda p: tree.match(p, len(p)), lambda res: res.matched_len == prompt_len // 4 or sys.exit("bad partial"))

    # -- misses: a fresh prompt; every insert adds 128 nodes, then 128 LRU pages are evicted
    # (untimed, and timed separately) so the tree stays at args.blocks blocks. -------------------
    def fresh_prompt_and_pages():
        return random_tokens(prompt_len), alloc.alloc(prompt_blocks)

    timed("match, miss", args.reps, lambda: random_tokens(prompt_len),
          lambda p: tree.match(p, len(p)), lambda res: res.matched_len == 0 or sys.exit("unexpected hit"))

    evict_ns: list[int] = []

    def evict_back(_):
        t0 = timer()
        freed = tree.evict(tree.num_nodes - args.blocks)
        evict_ns.append(timer() - t0)
        assert freed == prompt_blocks

    timed("insert, miss (128 new blocks)", args.miss_reps, fresh_prompt_and_pages,
          lambda pp: tree.insert(pp[0], pp[1]), evict_back)
    timed("match + insert, miss", args.miss_reps, fresh_prompt_and_pages,
          lambda pp: tree.insert(pp[0], tree.match(pp[0], len(pp[0])).pages + pp[1]), evict_back)
    results["evict 128 LRU leaves (10k-block tree)"] = summarize(evict_ns)
    tree.check_invariants()
    alloc.check_invariants()

    report = {
        "bench": "radix",
        "config": {
            "block_size": block,
            "tree_blocks": args.blocks,
            "prompt_tokens": prompt_len,
            "reps": args.reps,
            "miss_reps": args.miss_reps,
            "seed": args.seed,
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "machine": platform.machine(),
        },
        "results": results,
    }

    width = max(len(name) for name in results)
    print(f"block radix index: B={block}, tree={args.blocks} blocks, prompt={prompt_len} tokens "
          f"({platform.python_implementation()} {platform.python_version()})")
    print(f"{'operation':<{width}}  {'median us':>10}  {'p90 us':>9}  {'p99 us':>9}  {'min us':>8}  {'n':>5}")
    for name, row in results.items():
        print(f"{name:<{width}}  {row['median_us']:>10.1f}  {row['p90_us']:>9.1f}  {row['p99_us']:>9.1f}"
              f"  {row['min_us']:>8.1f}  {row['n']:>5}")
    print("(p99 on a shared, oversubscribed CPU mostly measures preemption; see min/median for the code's cost)")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
