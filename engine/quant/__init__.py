"""Quantized checkpoints: the scheme a checkpoint's `quantization_config` names, its reference
dequantization (the ground truth) and the linear layer that keeps the quantized weight in memory."""
