"""Atomic, asynchronous safetensors checkpoints with a JSON manifest."""

from mt_train.checkpoint.checkpointer import Checkpointer, TPLayout, load_into, resolve_resume
from mt_train.checkpoint.files import (
    CheckpointReader,
    latest_checkpoint,
    list_checkpoints,
    newest_valid_checkpoint,
    read_manifest,
    verify_checkpoint,
)

__all__ = [
    "CheckpointReader",
    "Checkpointer",
    "TPLayout",
    "latest_checkpoint",
    "list_checkpoints",
    "load_into",
    "newest_valid_checkpoint",
    "read_manifest",
    "resolve_resume",
    "verify_checkpoint",
]
