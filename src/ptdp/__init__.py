"""ptdp: GPT training with pipeline x tensor x data parallelism (PTD-P) on torch.distributed."""

__version__ = "0.1.0"
