"""Tiny DiffusionGemma checkpoints written by transformers' own classes (tests, benchmarks; needs torch).

:func:`write_tiny_diffusion_gemma` builds ``DiffusionGemmaForBlockDiffusion`` from a small config, perturbs every
parameter and buffer away from its initial value (norm weights, router scales and ``layer_scalar`` start at one,
which would hide a missing multiply), and writes it with ``save_pretrained``: the published layout, as transformers
writes it (tied tensors once, under the decoder's names; a small vision tower, loaded apart from the text model,
and the image processor's ``preprocessor_config.json``).
"""

from __future__ import annotations

import os

SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_text_config(**overrides) -> dict:
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                sliding_window=6, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                layer_types=[SLIDING, FULL, SLIDING, FULL], max_position_embeddings=512)
    text.update(overrides)
    return text


# patches of 4 x 4 pixels pooled 2 x 2: a test image of a few dozen pixels a side gives tens of soft tokens
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                   position_embedding_size=64)
TINY_MAX_SOFT_TOKENS = 70  # the image processor's smallest budget (280 patches of 4 x 4 at pooling 2)


def image_token_ids(vocab_size: int) -> dict:
    """The image tokens of a tiny checkpoint: the last three ids of its vocabulary (image, begin, end)."""
    return dict(image_token_id=vocab_size - 3, boi_token_id=vocab_size - 2, eoi_token_id=vocab_size - 1)


def build_tiny_diffusion_gemma(*, tie: bool = True, canvas_length: int = 4, seed: int = 0,
                               clipped_vision: bool = False, vision: dict | None = None, **text_overrides):
    """The torch model (float32, eval mode), perturbed as the module doc says."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    vision = dict(TINY_VISION, use_clipped_linears=clipped_vision, **(vision or {}))
    text = tiny_text_config(**text_overrides)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length,
                               tie_word_embeddings=tie, **image_token_ids(text["vocab_size"]))
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        seen = set()
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("input_min", "input_max", "output_min", "output_max")):
                # finite clip bounds (vision linears), tight enough that some values clamp
                p.fill_((-1.0 if name.endswith("min") else 1.0) * (1.5 if "input" in name else 0.25))
                continue
            if id(p) in seen or not p.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            seen.add(id(p))
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith(("layer_scalar", "per_expert_scale", "router.scale", "std_scale")) or "norm" in name:
                p.copy_(1.0 + 0.25 * noise)  # around one, as trained ones are
            else:
                p.copy_(0.08 * noise)
    return model


def write_tiny_diffusion_gemma(path, **kwargs):
    """Build (:func:`build_tiny_diffusion_gemma`), ``save_pretrained`` into ``path``; returns the torch model."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    model = build_tiny_diffusion_gemma(**kwargs)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    vision = model.config.vision_config  # the image processor's settings, as a published checkpoint ships them
    Gemma4ImageProcessorPil(patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size,
                            max_soft_tokens=TINY_MAX_SOFT_TOKENS).save_pretrained(path)
    return model
