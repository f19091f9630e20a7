"""The LoRA kernel: its decision and install (``feature``), the fused LoRA linears (``fused``)."""
