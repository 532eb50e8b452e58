"""Fixtures for tests and benchmarks: checkpoint directories in the published layouts (:mod:`.published`) and their
tokenizer files (:mod:`.tokenizer_files`). Production code (everything else under ``dllm_jax``) never imports this
package."""
