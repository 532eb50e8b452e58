"""A model directory's tokenizer, chosen without ``AutoTokenizer`` (nothing from the directory's own Python files is
ever imported), and the mask token it names."""

from __future__ import annotations

import json
import os
import sys

from dllm_jax.model.errors import CheckpointError

# Files a model directory's tokenizer and generation settings may come in (a converted directory copies them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json")
MASK_TOKEN_NAMES = ("<|MASK|>", "<|mask|>", "[MASK]", "<mask>")


def tokenizer_class(model_dir: str):
    """The transformers class that reads this directory's tokenizer, chosen WITHOUT ``AutoTokenizer``.

    ``AutoTokenizer`` follows a ``tokenizer_config.json`` / ``config.json`` ``auto_map`` into the directory's own
    Python files (and asks "Do you wish to run the custom code?" when ``trust_remote_code`` is unset). We never run
    a checkpoint's code, so the class is picked here: ``tokenizer_class`` from ``tokenizer_config.json`` when it
    names a tokenizer class that transformers itself ships (``Qwen2Tokenizer``, ``Qwen2TokenizerFast``, ...; a
    ``...Fast`` name that transformers no longer has is tried without the suffix); otherwise the generic
    ``tokenizer.json`` reader (``PreTrainedTokenizerFast``) when the directory has a ``tokenizer.json``, and
    ``Qwen2Tokenizer`` for a Qwen-family directory given as ``vocab.json`` + ``merges.txt``.
    Returns ``(class, reason)``; raises :class:`CheckpointError` when nothing fits.
    """
    if "transformers" not in sys.modules:  # its "PyTorch was not found" banner means nothing to a JAX engine
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    name = None
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                name = json.load(f).get("tokenizer_class")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a valid tokenizer config ({e})") from e
    if isinstance(name, str) and name.isidentifier():
        for candidate in (name, name[:-len("Fast")] if name.endswith("Fast") else None):
            if not candidate:
                continue
            try:
                cls = getattr(transformers, candidate)  # transformers' own modules only, never the directory's
            except (AttributeError, ImportError):
                continue
            if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
                return cls
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return transformers.PreTrainedTokenizerFast
    if all(os.path.isfile(os.path.join(model_dir, f)) for f in ("vocab.json", "merges.txt")):
        return transformers.Qwen2Tokenizer
    raise CheckpointError(f"{model_dir}: cannot load tokenizer: tokenizer_config.json names "
                          f"{name!r}, which is not a tokenizer class of transformers, and there is no tokenizer.json "
                          f"(nor vocab.json + merges.txt) to read instead")


def load_tokenizer(model_dir: str):
    """The directory's tokenizer (None if it has none), loaded with :func:`tokenizer_class`: never through
    ``AutoTokenizer`` and never from the directory's Python files, so loading asks nothing and runs no remote code.
    A ``chat_template.jinja`` beside it is the chat template (transformers reads it)."""
    if not (os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
            or os.path.isfile(os.path.join(model_dir, "tokenizer_config.json"))):
        return None
    cls = tokenizer_class(model_dir)
    try:
        return cls.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise CheckpointError(f"{model_dir}: cannot load tokenizer ({cls.__name__}; tokenizer.json / "
                              f"tokenizer_config.json / vocab.json + merges.txt): {e}") from e


def tokenizer_mask_id(tokenizer) -> int | None:
    """The tokenizer's mask token id: its ``mask_token``, else one of :data:`MASK_TOKEN_NAMES` in its vocabulary."""
    if tokenizer is None:
        return None
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    for name in MASK_TOKEN_NAMES:
        if name in vocab:
            return int(vocab[name])
    return None
