"""``dflash bench``: prompt sets, timed methods, pitfalls, remote benches and the SQLite history.

The runner (``runtime.bench.runner``) is the entry point; the CLI only renders its results.
"""
