"""The model a pool belongs to: loading it, telling it apart from others, and the transformers-version
differences every forward pass goes through.

- :mod:`~polykv_agents.model.loading`: ``load_model`` (embedded GGUF, a local directory, a cached hub id).
- :mod:`~polykv_agents.model.fingerprint`: what identifies a model for a pool.
- :mod:`~polykv_agents.model.architecture`: which model families and caches are supported, checked
  before any prefill.
- :mod:`~polykv_agents.model.compat`: the one place that knows transformers' cache API and keywords.
"""
