"""Serving: the HTTP APIs (Megatron and OpenAI request bodies), the guard in front of them, and the server"""
