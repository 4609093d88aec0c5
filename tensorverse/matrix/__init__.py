"""Matrix: run a corpus over a grid of vLLM settings (the hypercube) and bisect a flip to its cause."""
