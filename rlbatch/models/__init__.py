"""Model builders. ``rlbatch.models.tiny`` builds random-init Qwen2/Llama LMs from a config."""
