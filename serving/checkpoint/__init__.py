"""A checkpoint on disk: what its config.json says (`model_config`), how its weights are quantized
(`quantization`), its LoRA adapters (`lora_adapter`), where its directory is (`model_files`: the one
resolver of a local model dir and the hub's allow-list), the embedded default model and GGUF files
converted to HF-format dirs.

The ground floor of `serving`: imports nothing of it outside this package, so every layer may read it.
"""
