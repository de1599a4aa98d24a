"""Models: loading (preset, hub id, local dir, GGUF), info without weights, state maths, low-rank maths."""
