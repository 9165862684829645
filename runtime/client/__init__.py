"""Backends that talk to a server: ``RemoteBackend`` streams from an OpenAI-compatible endpoint
(``dflash serve``, vLLM, SGLang) as the same typed events a local pipeline yields."""
