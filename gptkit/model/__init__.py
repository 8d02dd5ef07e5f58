"""The model: the decoder (GPT and the Llama family), mixture-of-experts layers, and LoRA adapters"""
