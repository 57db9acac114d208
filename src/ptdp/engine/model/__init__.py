"""The GPT model, written as single-device code over ptdp's tensor-parallel layers."""
