"""Tokenizers: byte-level BPE (GPT-2 built in, training your own, one interface) and the fast exact encoders"""
