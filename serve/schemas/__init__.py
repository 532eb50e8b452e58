"""Request bodies (pydantic), validated before anything reaches the engine: :mod:`.common` (strict models, field
paths, stop and penalty fields), :mod:`.sglang` (``/generate``, admin bodies), :mod:`.openai` (``/v1/...``)."""

from serve.schemas.common import MAX_N, MAX_TOP_LOGPROBS, format_loc
from serve.schemas.openai import (CHAT_FIELD_NAMES, OPENAI_FIELD_NAMES, ChatCompletionRequest, CompletionRequest,
                                  OpenAICommon)
from serve.schemas.sglang import AbortRequest, GenerateRequest, ProfileRequest, SamplingParamsBody

__all__ = ["MAX_N", "MAX_TOP_LOGPROBS", "format_loc", "CHAT_FIELD_NAMES", "OPENAI_FIELD_NAMES",
           "ChatCompletionRequest", "CompletionRequest", "OpenAICommon", "AbortRequest", "GenerateRequest",
           "ProfileRequest", "SamplingParamsBody"]
