"""The tiny transformers models the integration tests train, built once here."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(vocab: int) -> Any:
    """A two-layer Llama config of hidden 32 (4 heads, 2 of them key/value), 64 positions."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
