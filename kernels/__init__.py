"""Triton dequant kernels and their plain-torch references, matched to artifact formats."""
