"""A device stack's start-up checks beyond npu_ops.py: Ascend's, read from versions and variables."""
