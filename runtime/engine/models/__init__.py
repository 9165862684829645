"""What the decode loop runs: the target adapter and its lean forward, the drafter, KV caches,
projections and the native kernels, and the drafter's corpus table (files read from disk and the
modules built from them). Nothing here imports the decoding files above (``runtime/engine/*.py``)."""
