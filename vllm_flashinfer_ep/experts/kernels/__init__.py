"""Triton kernels over the received rows: tensors in, tensors out, no decisions."""
