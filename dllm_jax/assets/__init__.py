"""The small block-diffusion model shipped with the package (trained by ``python -m dllm_jax.train``).

``DEFAULT_MODEL_PATH`` is a standard Hugging Face directory (config.json with ``mask_token_id`` and
``block_size``, model.safetensors, tokenizer files with a chat template, generation_config.json).
"""

import os

DEFAULT_MODEL_NAME = "sdar-tiny"
DEFAULT_MODEL_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_MODEL_NAME)

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_PATH"]
