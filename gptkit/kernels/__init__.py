"""Kernels: the plain references, the fused Triton kernels, their ahead-of-time builds, and the QK and MoE kernels"""
