"""Parallelism: process groups and the pipeline schedule, tensor parallelism, and expert parallelism"""
