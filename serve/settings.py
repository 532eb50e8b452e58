"""The server's settings (the engine's are its own: ``dllm_jax.Engine(...)``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ServerSettings:
    served_model_name: str | None = None  # default: the model directory's name
    api_key: str | None = None
    max_queued_requests: int = 256  # engine requests waiting beyond max_running_requests
    max_prompt_tokens: int | None = None  # default: what fits the engine's context
    max_request_bytes: int = 8 << 20
    incremental_streaming_output: bool = False
    profile_dir: str | None = None
    disconnect_poll_s: float = 0.25
    retry_after_s: int = 1
    playground: bool = True  # the page at /

    def __post_init__(self):
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {self.max_queued_requests}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}")
