"""Compute ops: PyTorch references, native CPU kernels (ops.native) and Triton GPU kernels.

Which implementation a layer runs is chosen once, by the memory plan, from what the layer kind
declares (e.g. `hybridkv.layers.mamba2.MAMBA2_OPS`, implemented in `ops.mamba2_ops`); the
functions here never try one implementation after another.
"""
