"""Sizing before running: parameters, memory per GPU, FLOPs and layouts, MoE terms, the performance model"""
