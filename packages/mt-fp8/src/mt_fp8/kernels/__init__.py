"""Triton kernels. Every module here imports ``triton``; they are imported only for CUDA tensors."""
