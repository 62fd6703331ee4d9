"""rlbatch: reinforcement-learning post-training for LLMs as a plain Slurm/MPI batch job.

Importing the package is cheap: it pulls in no torch, no engine and no MPI, so a dry run or a
config error on a login node is instant.
"""

from rlbatch.errors import ConfigError

__all__ = ["ConfigError", "__version__"]
__version__ = "0.1.0"
