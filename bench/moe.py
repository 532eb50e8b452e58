"""``moe`` scenario (issue #10): a random SDAR-MoE model against a dense model of the same *active* size.

Both models share everything but the MLP: the MoE one has 8 experts of width I / 2 with top-2 routing in every
layer (so each token runs 2 x I / 2 = I of MLP width, like the dense one), i.e. about 4x the MLP parameters at
the dense model's per-token MLP FLOPs. The experts run as one grouped matmul (``jax.lax.ragged_dot``), so the
figure to watch is how close the MoE model gets to the dense one's tokens/s (on CPU ragged_dot is computed as a
masked dense product over all experts, which costs about E / k times the active work: read the ratio as this
CPU's cost of exact capacity-free routing, not as the GPU's).
"""

from __future__ import annotations

from bench import plots
from bench.common import Ctx, ModelInfo, chat_prompts, random_model, table

BASE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64)
DENSE_WIDTH = 512


def _models(ctx: Ctx) -> list[ModelInfo]:
    shapes = {
        "dense-active": dict(BASE, intermediate_size=DENSE_WIDTH),
        "moe-8x2": dict(BASE, intermediate_size=0, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=DENSE_WIDTH // 2, moe_layers=tuple(range(BASE["num_layers"])),
                        norm_topk_prob=True, architecture="SDARMoeForCausalLM", model_type="sdar_moe"),
    }
    return [random_model(ctx, name, f"{name}-v1", f"random {name}", shape, max_pos=512)
            for name, shape in shapes.items()]


def moe(ctx: Ctx) -> dict:
    from bench.scenarios import engine_run, finish

    levels = [1, 8] if ctx.quick else [1, 8, 32]
    max_new = 32 if ctx.quick else 64
    rows, out = [], {"models": {}}
    models = _models(ctx)
    tps = {}
    for m in models:
        prompts = chat_prompts(m.tokenizer, max(levels))
        out["models"][m.name] = {"params": m.num_params, "levels": {}}
        for level in levels:
            r = engine_run(ctx, m, prompts[:level] if level > 1 else prompts[:2], max_new, level, tag="moe")
            tps[(m.name, level)] = r["tokens_per_s"]
            out["models"][m.name]["levels"][level] = {k: r[k] for k in ("tokens_per_s", "tpf", "recompiles")}
            rows.append([m.name, f"{m.num_params / 1e6:.1f}M", level, r["tokens_per_s"], r["tpf"], r["recompiles"]])
    for level in levels:
        ratio = tps[("moe-8x2", level)] / tps[("dense-active", level)]
        out.setdefault("moe_over_dense", {})[level] = ratio
        rows.append(["moe / dense", "", level, ratio, "", ""])
    text = table("moe: random SDAR-MoE (8 experts, top-2) vs dense of the same active MLP width, FDFO greedy",
                 ["model", "params", "requests", "tok/s", "fwd/token", "recompiles"], rows)

    def plot(path):
        series = {m.name: (levels, [tps[(m.name, lv)] for lv in levels]) for m in models}
        return plots.lines(path, "MoE vs dense (same active size)", [("concurrent requests", "output tokens/s",
                                                                       series)], logx=True)

    return finish(ctx, "moe", out, text, plot)
