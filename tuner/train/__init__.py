"""Training the tuner model (torch, sentencepiece and gguf are imported only in this package)."""
