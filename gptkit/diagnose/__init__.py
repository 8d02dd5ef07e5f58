"""Diagnosis: profiling training steps, measuring memory against the estimate, and checking a machine (gptkit doctor)"""
