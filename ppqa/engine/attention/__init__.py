"""Attention backends behind one seam (`metadata`): the torch reference, the Triton kernels, and
FlashInfer's decode as a second stock baseline."""
