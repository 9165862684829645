"""Models on disk and on the Hub: reference resolution, presets, the embedded pair, pair checks,
reading model folders (and a target's config) without loading weights, the local store, pair
downloads, and quantized folders with their schemes. Below the pipeline: nothing here imports it."""
