"""Bodies of the RL endpoints (SGLang's names and fields): weight updates, weight versions, pause / continue."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serve.schemas.common import Body


class UpdateWeightsFromDiskRequest(Body):
    model_path: str = Field(min_length=1)
    weight_version: str | None = Field(None, min_length=1)
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None  # SGLang's; the format is read from the directory itself


class UpdateWeightsFromTensorRequest(Body):
    # base64 of a safetensors blob (dllm_jax.model.weight_update.encode_tensors), or several (applied as one)
    serialized_named_tensors: str | list[str]
    weight_version: str | None = Field(None, min_length=1)
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: Literal["safetensors"] | None = None  # pickled tensors are never accepted


class GetWeightsByNameRequest(Body):
    name: str = Field(min_length=1)
    truncate_size: int | None = Field(100, ge=0)


class UpdateWeightVersionRequest(Body):
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = False


class PauseGenerationRequest(Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(Body):
    tags: list[str] | None = None  # "weights", "kv_cache" (None: both)


class ScoreRequest(Body):
    """One prompt (``text`` or ``input_ids``), or a batch (a list of texts, a list of id lists: every completion
    scored after each prompt, one list of results per prompt)."""

    text: str | list[str] | None = None  # the prompt, raw (no chat template applied)
    input_ids: list[int] | list[list[int]] | None = None
    completions: list[str | list[int]] = Field(min_length=1)
    estimator: str = "chain"
    num_samples: int = 8
    seed: int = 0

    @model_validator(mode="after")
    def _one_prompt_field(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of text or input_ids")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text: an empty batch")
        return self
