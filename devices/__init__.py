"""A device stack's start-up checks beyond npu_ops.py: Ascend's, from versions and variables."""
