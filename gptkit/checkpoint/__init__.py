"""Save and resume: DeepSpeed checkpoints with config and tokenizer, strict loading on any layout, experts"""
