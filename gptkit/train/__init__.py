"""Training: the DeepSpeed engine and its schedule, the run plan, the loop, stops, callbacks and micro-batches"""
