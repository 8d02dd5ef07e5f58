"""Other tools' formats: Hugging Face config.json and safetensors, conversion both ways, Megatron-LM checkpoints"""
