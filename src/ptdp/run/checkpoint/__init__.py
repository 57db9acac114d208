"""Checkpoints: save, resume, load at any layout (torch.distributed.checkpoint)."""
