"""Models on disk and on the Hub: reference resolution, presets, the embedded pair, pair checks,
reading model folders without loading weights, the local store and pair downloads."""
