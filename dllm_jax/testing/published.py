"""Checkpoint directories in the layouts SDAR / SDAR-MoE / LLaDA2 are published in, with random weights.

The tests' fixtures and the load benchmark (``python -m bench load``) both write their checkpoints here, so the
layout the tests check is the one the benchmark measures. This package (:mod:`dllm_jax.testing`) is for tests and
benchmarks: production code never imports it. The names and shapes here are written from the published
checkpoints, independently of the loader's parameter table, so a wrong table entry fails the tests instead of
agreeing with itself. A published directory has:

* ``config.json`` with every key the published ones carry, used or not (``auto_map`` into remote code,
  ``attn_implementation: "flex_attention"``, ``fuse_cross_entropy``, ``micro_forward``, ``use_deepep``, ...);
* bfloat16 weights in sharded safetensors (``model-0000k-of-0000n.safetensors``) plus
  ``model.safetensors.index.json``;
* ``generation_config.json`` (an EOS list and sampling defaults);
* a Qwen2 tokenizer given only as ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json`` +
  ``added_tokens.json`` (no ``tokenizer.json``), and ``chat_template.jinja`` (SDAR), or ``tokenizer.json`` with
  the template in ``tokenizer_config.json`` (LLaDA2);
* the remote-code ``.py`` files ``auto_map`` names (here: modules that raise on import, so a loader that imports
  them fails loudly).

Weights are generated and written one tensor at a time, so a full-size checkpoint (the 1.7B shape: 3.2 GiB) is
written in bounded memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from dllm_jax.model.safetensors_io import BF16, write_sharded
from dllm_jax.testing.tokenizer_files import (LLADA2_MASK_TOKEN, SDAR_MASK_TOKEN, write_fast_tokenizer,
                                         write_qwen2_tokenizer)


# ----------------------------------------------------------------------------------------------
# config.json / generation_config.json
# ----------------------------------------------------------------------------------------------

# The SDAR-1.7B-Chat shape (Qwen3-1.7B): what `python -m bench load` writes at full depth.
SDAR_1P7B_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def sdar_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                num_attention_heads: int, num_key_value_heads: int, head_dim: int, tie_word_embeddings: bool = True,
                mask_token_id: int | None = 151669, block_size: int | None = 4, bos_token_id: int = 151643,
                eos_token_id: int = 151643, max_position_embeddings: int = 32768) -> dict:
    """A dense SDAR ``config.json`` with the published keys (``model_type: "sdar"``, remote-code ``auto_map``)."""
    cfg = {
        "architectures": ["SDARForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_implementation": "flex_attention",
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "bos_token_id": bos_token_id,
        "debug": False,
        "eos_token_id": eos_token_id,
        "ep_size": 1,
        "fuse_cross_entropy": True,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_hidden_layers,
        "micro_forward": False,
        "model_type": "sdar",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "skip_checkpoint": False,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.4",
        "use_cache": False,
        "use_deepep": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    if mask_token_id is not None:
        cfg["mask_token_id"] = mask_token_id
    if block_size is not None:
        cfg["block_size"] = block_size
    return cfg


def sdar_moe_config(*, num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int,
                    norm_topk_prob: bool = True, mlp_only_layers=(), **dense) -> dict:
    """An SDAR-MoE (SDAR-30B-A3B style, Qwen3-MoE backbone) ``config.json`` with the published keys."""
    cfg = sdar_config(**dense)
    cfg.update({
        "architectures": ["SDARMoeForCausalLM"],
        "model_type": "sdar_moe",
        "auto_map": {
            "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
            "AutoModel": "modeling_sdar_moe.SDARMoeModel",
            "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
        },
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(mlp_only_layers),
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": norm_topk_prob,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    })
    return cfg


def llada2_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                  num_attention_heads: int, num_key_value_heads: int, head_dim: int, num_experts: int,
                  num_experts_per_tok: int, moe_intermediate_size: int, n_group: int, topk_group: int,
                  num_shared_experts: int = 1, first_k_dense_replace: int = 1, eos_token_id: int = 156892,
                  pad_token_id: int = 156892, max_position_embeddings: int = 16384) -> dict:
    """A LLaDA2.0-mini style ``config.json`` (``LLaDA2MoeModelLM``) with the published keys. No mask id in it:
    the mask token (``<|mask|>``) comes from the tokenizer."""
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "embedding_dropout": 0.0,
        "eos_token_id": eos_token_id,
        "first_k_dense_replace": first_k_dense_replace,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_hidden_layers,
        "model_type": "llada2_moe",
        "moe_intermediate_size": moe_intermediate_size,
        "moe_router_enable_expert_bias": True,
        "moe_shared_expert_intermediate_size": moe_intermediate_size,
        "n_group": n_group,
        "norm_head": False,
        "norm_softmax": False,
        "norm_topk_prob": True,
        "num_attention_heads": num_attention_heads,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "num_shared_experts": num_shared_experts,
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": pad_token_id,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 600000,
        "rotary_dim": head_dim // 2,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": topk_group,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.3",
        "use_bias": False,
        "use_cache": True,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "use_sliding_window": False,
        "using_split_qkv_in_self_attention": False,
        "vocab_size": vocab_size,
    }


def sdar_generation_config(eos_token_ids=(151645, 151643), pad_token_id: int = 151643,
                           bos_token_id: int = 151643) -> dict:
    """SDAR's ``generation_config.json`` (Qwen3's: an EOS list and sampling defaults)."""
    return {"bos_token_id": bos_token_id, "do_sample": True, "eos_token_id": list(eos_token_ids),
            "pad_token_id": pad_token_id, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
            "transformers_version": "4.52.4"}


# ----------------------------------------------------------------------------------------------
# Weights: names and shapes in the published layout, random values, sharded safetensors
# ----------------------------------------------------------------------------------------------

def tensor_specs(config: dict) -> list[tuple[str, tuple, str]]:
    """``(name, shape, kind)`` of every tensor the published checkpoint of ``config`` holds, in module order;
    ``kind`` is ``"norm"``, ``"bias"``, ``"embed"`` or ``"matrix"`` (how :func:`random_tensor` fills it)."""
    h, d = config["hidden_size"], config["head_dim"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    llada2 = config["model_type"] == "llada2_moe"
    out: list[tuple[str, tuple, str]] = [
        ("model.word_embeddings.weight" if llada2 else "model.embed_tokens.weight", (vocab, h), "embed")]
    num_experts = config.get("num_experts") or 0
    for i in range(layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,), "norm"))
        if llada2:
            out.append((p + "attention.query_key_value.weight", ((nq + 2 * nkv) * d, h), "matrix"))
            out.append((p + "attention.query_layernorm.weight", (d,), "norm"))
            out.append((p + "attention.key_layernorm.weight", (d,), "norm"))
            out.append((p + "attention.dense.weight", (h, nq * d), "matrix"))
        else:
            out += [(p + "self_attn.q_proj.weight", (nq * d, h), "matrix"),
                    (p + "self_attn.k_proj.weight", (nkv * d, h), "matrix"),
                    (p + "self_attn.v_proj.weight", (nkv * d, h), "matrix"),
                    (p + "self_attn.o_proj.weight", (h, nq * d), "matrix"),
                    (p + "self_attn.q_norm.weight", (d,), "norm"),
                    (p + "self_attn.k_norm.weight", (d,), "norm")]
        out.append((p + "post_attention_layernorm.weight", (h,), "norm"))
        if llada2:
            sparse = num_experts and i >= config["first_k_dense_replace"]
        else:
            sparse = num_experts and i not in config.get("mlp_only_layers", []) and \
                (i + 1) % config.get("decoder_sparse_step", 1) == 0
        if not sparse:
            m = config["intermediate_size"]
            out += [(p + "mlp.gate_proj.weight", (m, h), "matrix"), (p + "mlp.up_proj.weight", (m, h), "matrix"),
                    (p + "mlp.down_proj.weight", (h, m), "matrix")]
            continue
        m = config["moe_intermediate_size"]
        out.append((p + "mlp.gate.weight", (num_experts, h), "router"))
        if llada2 and config.get("moe_router_enable_expert_bias"):
            out.append((p + "mlp.gate.expert_bias", (num_experts,), "expert_bias"))
        for e in range(num_experts):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (m, h), "matrix"), (q + "up_proj.weight", (m, h), "matrix"),
                    (q + "down_proj.weight", (h, m), "matrix")]
        if llada2 and config.get("num_shared_experts"):
            s = config["moe_shared_expert_intermediate_size"] * config["num_shared_experts"]
            q = p + "mlp.shared_experts."
            out += [(q + "gate_proj.weight", (s, h), "matrix"), (q + "up_proj.weight", (s, h), "matrix"),
                    (q + "down_proj.weight", (h, s), "matrix")]
    out.append(("model.norm.weight", (h,), "norm"))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h), "matrix"))
    return out


def random_tensor(rng: np.random.Generator, shape: tuple, kind: str, *, std: float, embed_std: float) -> np.ndarray:
    """Random values for one tensor, as bfloat16 (the expert bias as float32, as LLaDA2 stores it)."""
    if kind == "norm":
        a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif kind == "expert_bias":
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    else:
        scale = embed_std if kind == "embed" else 2.0 * std if kind == "router" else std
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= scale
    return a.astype(BF16)


def write_weights(out_dir: str, config: dict, *, seed: int = 0, std: float = 0.02, embed_std: float = 0.02,
                  max_shard_bytes: int = 1 << 30, keep: dict | None = None) -> list[str]:
    """Random weights for ``config`` in its published layout (bf16, sharded). Each tensor is generated when it is
    written (bounded memory; deterministic per name and seed). ``keep``, if given, receives every tensor (tests
    that compare against a reference need the values)."""
    specs = tensor_specs(config)
    kinds = {name: kind for name, _, kind in specs}
    shapes = {name: shape for name, shape, _ in specs}

    def fill(name):
        rng = np.random.default_rng([seed, _stable_hash(name)])
        a = random_tensor(rng, shapes[name], kinds[name], std=std, embed_std=embed_std)
        if keep is not None:
            keep[name] = a
        return a

    declared = [(name, shape, np.float32 if kind == "expert_bias" else BF16) for name, shape, kind in specs]
    return write_sharded(out_dir, declared, fill, max_shard_bytes=max_shard_bytes)


def _stable_hash(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def checkpoint_bytes(model_dir: str) -> int:
    """Bytes of the safetensors data (what "the checkpoint's bytes" means in the load targets)."""
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
               if f.endswith(".safetensors"))


def write_remote_code_traps(out_dir: str, config: dict, tokenizer_config: dict | None = None) -> list[str]:
    """The ``.py`` files ``auto_map`` names, each raising on import (and leaving a ``REMOTE_CODE_IMPORTED``
    file beside it), so a loader that imports the directory's code fails instead of passing silently."""
    modules = set()
    for ref in (config.get("auto_map") or {}).values():
        modules.add(ref.split(".")[0])
    for refs in ((tokenizer_config or {}).get("auto_map") or {}).values():
        for ref in refs if isinstance(refs, list) else [refs]:
            if ref:
                modules.add(ref.split(".")[0])
    paths = []
    for module in sorted(modules):
        path = os.path.join(out_dir, module + ".py")
        with open(path, "w") as f:
            f.write("import os\n"
                    "open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'REMOTE_CODE_IMPORTED'), 'a')"
                    ".write(__name__ + '\\n')\n"
                    f"raise RuntimeError('remote code {module}.py was imported: loading must never run it')\n")
        paths.append(path)
    return paths


def padded_vocab(num_tokens: int, multiple: int = 64) -> int:
    """The config's ``vocab_size``: the tokenizer's size rounded up (Qwen pads 151,669 tokens to 151,936)."""
    return int(math.ceil(num_tokens / multiple) * multiple)


# ----------------------------------------------------------------------------------------------
# A whole published directory
# ----------------------------------------------------------------------------------------------

LAYOUTS = ("sdar", "sdar_moe", "llada2")

# Test-sized dimensions (a few hundred KB of weights; the vocabulary is the tokenizer's, padded to 64).
TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
TINY_MOE_DIMS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_LLADA2_DIMS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2)


@dataclasses.dataclass
class Published:
    """What :func:`write_published` wrote: the directory, its config dicts and the special ids in it."""
    path: str
    layout: str
    config: dict
    generation_config: dict
    token_ids: dict  # added token -> id
    mask_token_id: int
    eos_token_ids: tuple
    shards: list
    tensors: dict | None = None  # name -> bf16 array, when ``keep_tensors``

    @property
    def checkpoint_bytes(self) -> int:
        return checkpoint_bytes(self.path)


def write_published(out_dir: str, layout: str = "sdar", *, dims: dict | None = None, seed: int = 0,
                    std: float = 0.02, embed_std: float = 0.02, max_shard_bytes: int = 1 << 30,
                    keep_tensors: bool = False, remote_code_traps: bool = True, bpe_vocab: int = 400,
                    block_size: int | None = 4) -> Published:
    """Write a checkpoint directory in a published layout with random bf16 weights.

    ``layout``: ``"sdar"`` (SDAR-*-Chat: Qwen3 dense, Qwen2 tokenizer as vocab/merges/config/added tokens,
    ``chat_template.jinja``, ``generation_config.json`` with an EOS list and sampling defaults), ``"sdar_moe"``
    (SDAR-30B-A3B: Qwen3-MoE, same tokenizer files) or ``"llada2"`` (LLaDA2.0-mini: ``LLaDA2MoeModelLM``, fused
    QKV, grouped sigmoid routing, ``tokenizer.json``). ``dims`` overrides the model dimensions (default: tiny
    test sizes; :data:`SDAR_1P7B_SHAPE` is the 1.7B one); ``vocab_size`` defaults to the tokenizer's size padded
    to 64, and is never smaller than it. The special ids (mask, EOS) are the tokenizer's, so config and
    tokenizer agree as they do in the published directories (there the ids are 151669 and 151645 / 151643).
    With ``remote_code_traps`` the ``.py`` files ``auto_map`` names are written, each raising on import.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    os.makedirs(out_dir, exist_ok=True)
    base = dict(TINY_DIMS, **({"sdar_moe": TINY_MOE_DIMS, "llada2": TINY_LLADA2_DIMS}.get(layout, {})))
    dims = dict(base, **(dims or {}))
    if layout == "llada2":
        ids = write_fast_tokenizer(out_dir, bpe_vocab=bpe_vocab)
        vocab = max(int(dims.pop("vocab_size", 0) or 0), padded_vocab(max(ids.values()) + 1))
        dims.pop("tie_word_embeddings", None)
        eos = ids["<|endoftext|>"]
        config = llada2_config(vocab_size=vocab, eos_token_id=eos, pad_token_id=eos, **dims)
        mask = ids[LLADA2_MASK_TOKEN]
        eos_ids = (eos, ids["<|role_end|>"])
        generation = {"bos_token_id": eos, "eos_token_id": list(eos_ids), "pad_token_id": eos,
                      "transformers_version": "4.52.3"}
        with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
            tokenizer_config = json.load(f)
    else:
        ids = write_qwen2_tokenizer(out_dir, bpe_vocab=bpe_vocab)
        vocab = max(int(dims.pop("vocab_size", 0) or 0), padded_vocab(max(ids.values()) + 1))
        mask = ids[SDAR_MASK_TOKEN]
        eos_ids = (ids["<|im_end|>"], ids["<|endoftext|>"])
        endoftext = ids["<|endoftext|>"]
        common = dict(vocab_size=vocab, mask_token_id=mask, block_size=block_size, bos_token_id=endoftext,
                      eos_token_id=endoftext)
        if layout == "sdar_moe":
            moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                        "mlp_only_layers")
            moe = {k: dims.pop(k) for k in moe_keys if k in dims}
            config = sdar_moe_config(**moe, **common, **dims)
        else:
            config = sdar_config(**common, **dims)
        generation = sdar_generation_config(eos_token_ids=eos_ids, pad_token_id=endoftext, bos_token_id=endoftext)
        with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
            tokenizer_config = json.load(f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    keep = {} if keep_tensors else None
    shards = write_weights(out_dir, config, seed=seed, std=std, embed_std=embed_std, max_shard_bytes=max_shard_bytes,
                           keep=keep)
    if remote_code_traps:
        write_remote_code_traps(out_dir, config, tokenizer_config)
    return Published(path=os.path.abspath(out_dir), layout=layout, config=config, generation_config=generation,
                     token_ids=ids, mask_token_id=mask, eos_token_ids=eos_ids, shards=shards, tensors=keep)
