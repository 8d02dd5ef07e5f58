"""Inference: picking tokens and releasing text, continuous batching, the CPU decode layout, and the generator"""
