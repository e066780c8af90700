"""Fusion passes: FP8 quantization fused into the op before it (RMSNorm, SiluAndMul,
attention), and the pattern-matching helpers they share (`matcher_utils`)."""
