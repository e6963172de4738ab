"""The perplexity engine: plain PyTorch over one token stream. It imports nothing of ours but ``tasks.core``."""
