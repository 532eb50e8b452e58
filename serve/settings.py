"""The server's settings (the engine's are its own: ``dllm_jax.Engine(...)``)."""

from __future__ import annotations

import dataclasses
import os

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def default_profile_dir() -> str:
    """Where ``/start_profile`` may write by default: a per-user cache directory, never the working directory."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "dllm-jax", "profiles")


def _names(value) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> ``["a", "b"]`` (blanks dropped)."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


@dataclasses.dataclass
class ServerSettings:
    served_model_name: str | None = None  # "name[,alias...]"; default: the model directory's name
    api_key: str | None = None
    max_queued_requests: int = 256  # engine requests waiting beyond max_running_requests
    max_prompt_tokens: int | None = None  # default: what fits the engine's context
    max_request_bytes: int = 8 << 20
    incremental_streaming_output: bool = False
    profile_dir: str | None = None  # the root /start_profile writes under (default: default_profile_dir())
    disconnect_poll_s: float = 0.25
    retry_after_s: int = 1
    playground: bool = True  # the page at /
    # where the server listens, for the Host check (serve.limits); None: not known (create_app in Python)
    host: str | None = None
    # Host names accepted beyond localhost and IP addresses ("name" any port, "name:port" that port only, "*" any
    # Host); default: none, or any Host when bound to a wildcard address with an API key
    allowed_hosts: list[str] | str | None = None
    body_timeout_s: float = 30.0  # a request body must arrive within this (else 408 and the connection closes)

    def __post_init__(self):
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {self.max_queued_requests}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s: must be > 0, got {self.body_timeout_s}")
        if self.served_model_name is not None and not _names(self.served_model_name):
            raise ValueError(f"served_model_name: no name in {self.served_model_name!r}")
        self.allowed_hosts = None if self.allowed_hosts is None else [h.lower() for h in _names(self.allowed_hosts)]

    @property
    def served_model_names(self) -> list[str]:
        """The served names, the primary (reported in answers) first; empty: the model directory's name."""
        return _names(self.served_model_name)

    @property
    def profile_root(self) -> str:
        """The profile root, absolute with its symbolic links resolved (created when first written to)."""
        return os.path.realpath(os.path.expanduser(self.profile_dir or default_profile_dir()))

    @property
    def any_host(self) -> bool:
        """Whether the Host check is off: ``--allowed-hosts '*'``, or a wildcard bind guarded by an API key with no
        ``--allowed-hosts`` (a DNS-rebinding page cannot know the key; see serve/README.md, Threat model)."""
        if self.allowed_hosts is not None:
            return "*" in self.allowed_hosts
        return bool(self.api_key) and self.host is not None and self.host.strip("[]") in WILDCARD_HOSTS
