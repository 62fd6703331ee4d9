"""Model descriptions and builders.

``rlbatch.models.spec`` describes a model (torch-free: the planner reads it too);
``rlbatch.models.tiny`` builds a random-init Qwen2/Llama LM from that description;
``rlbatch.models.weights`` reads weights by rows (a seeded random init, safetensors files) into a
model whose parameters are on the meta device, whole or one rank's shard.
"""
