"""Layers: linear (tensor parallel), RMSNorm, SiluAndMul, rotary, embeddings, logits, MoE."""
