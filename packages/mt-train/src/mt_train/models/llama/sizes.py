"""The Llama family's named sizes: the ``model=<name>`` options of ``mt-train``.

Every key can still be overridden on the command line (``model=llama3_1b model.n_layers=4``).
Published shapes are Meta's Llama 3.x configs; mt trains every Llama with untied embeddings.
"""

from __future__ import annotations

from mt_train.models.llama.config import LlamaConfig, RopeScalingConfig

SIZES: dict[str, LlamaConfig] = {
    # A small Llama (4 layers, width 128, GQA 4:2) that learns the bundled corpus in minutes on
    # a CPU; the vocabulary is the tokenizer's, rounded up to a multiple of 64.
    "debug": LlamaConfig(name="debug", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384),
    # A ~125M-parameter Llama for the bundled byte-level corpus (14 layers, width 768, GQA 12:4,
    # FFN 3072): 121,624,320 parameters with the byte vocabulary (257 rounded up to 320), counted
    # with ModelFamily.num_params; every linear dimension is a multiple of 16 for FP8. The
    # FP8-vs-bf16 quality runs use it (benchmarks/fp8_quality.py).
    "llama_125m": LlamaConfig(
        name="llama_125m", dim=768, n_layers=14, n_heads=12, n_kv_heads=4, ffn_dim=3072
    ),
    # Llama 3.2 1B shapes (16 layers, width 2048, 32 query / 8 KV heads, FFN 8192, vocab
    # 128256). Meta ties this model's embeddings; mt trains it untied.
    "llama3_1b": LlamaConfig(
        name="llama3_1b",
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_scaling=RopeScalingConfig(factor=32.0),
    ),
    # Llama 3.1 8B shapes (32 layers, width 4096, 32 query / 8 KV heads, FFN 14336, vocab 128256).
    "llama3_8b": LlamaConfig(
        name="llama3_8b",
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
    ),
    # Llama 3.1 70B shapes (80 layers, width 8192, 64 query / 8 KV heads, FFN 28672, vocab 128256).
    "llama3_70b": LlamaConfig(
        name="llama3_70b",
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
    ),
}
