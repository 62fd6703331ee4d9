"""Model descriptions and builders.

``rlbatch.models.spec`` describes a model (torch-free: the planner reads it too);
``rlbatch.models.tiny`` builds a random-init Qwen2/Llama LM from that description.
"""
