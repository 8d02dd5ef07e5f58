"""Evaluation: perplexity on datasets and text, lm-evaluation-harness on a gptkit model, task folders as data"""
