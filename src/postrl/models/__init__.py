"""Models: loading, weights and sync manifests, GGUF, devices."""
