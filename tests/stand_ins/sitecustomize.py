"""Loads the CUDA-only stand-ins (``cuda_only``) in every Python process started with this
directory on ``PYTHONPATH``: the tests' SGLang engines and the processes SGLang spawns."""

import cuda_only

cuda_only.install()
