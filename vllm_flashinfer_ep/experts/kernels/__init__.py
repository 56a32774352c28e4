"""Triton kernels over the received rows: tensors in, tensors out, no decisions.

What runs which kernel is the experts classes' business (experts/received_rows.py and
the scheme table, experts/schemes.py).
"""
