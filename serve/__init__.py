"""HTTP serving for dllm-jax: a FastAPI app with SGLang- and OpenAI-style endpoints (see :mod:`serve.app` for the layout).

``from serve import create_app``; ``uvicorn --factory serve:create_app`` (flags in ``$DLLM_JAX_SERVE_ARGS``);
``python -m serve ...`` or ``dllm-jax serve ...``. Importing ``serve`` itself is cheap: FastAPI is imported when
the app is first asked for.
"""

__all__ = ["create_app", "ServerSettings"]


def __getattr__(name):
    if name == "create_app":
        from serve.app import create_app

        return create_app
    if name == "ServerSettings":
        from serve.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module 'serve' has no attribute {name!r}")
