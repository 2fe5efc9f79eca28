"""Glue between the cache and the programs that serve it (each an optional dependency).

The engine (everything else in moet_cache) never imports this package; a serving program imports it
through its own plugin mechanism (vLLM: the `vllm.general_plugins` entry point, integrations.vllm.plugin).
"""
