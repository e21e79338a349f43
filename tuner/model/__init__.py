"""The tuner model at run time: GGUF checks, llama.cpp inference and the top-K proposer (no torch here)."""
