"""Tiny random-weight Llama models that vLLM for CPU loads (see make_models.py)."""
