"""Device code: which device and dtype each component uses (`device`), and the CUDA side
stream the trainer thread runs on (`streams`). CPU paths are what the tests run."""
