"""Checkpoints: atomic verified directories (store), sharded train state (dcp), HF export
(hf_export).

Importing this package is cheap (no torch): the controller uses the store; ranks import
``rlbatch.checkpoint.engine_state`` (DCP, torch) to write and read their part.
"""

from rlbatch.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, Scan, open_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "CheckpointStore", "Scan", "open_checkpoint"]
