"""Triton kernels.  Imported lazily by dspec.ops: importing dspec never needs triton.

Set ``TRITON_INTERPRET=1`` before importing these modules to run them on CPU tensors.
"""
