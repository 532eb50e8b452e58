"""The endpoints, one router per API family: :mod:`.sglang` (``/generate``), :mod:`.openai` (``/v1/...``),
:mod:`.admin` (health, info, metrics, cache, profiler, aborts), :mod:`.rl` (weight updates, pause / continue),
:mod:`.playground` (the page at ``/``)."""
