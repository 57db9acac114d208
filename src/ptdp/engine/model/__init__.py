"""The GPT model, written as single-device code over ptdp's tensor-parallel layers."""

from ptdp.engine.model.gpt import GPTModel

__all__ = ["GPTModel"]
