"""From text to token files: corpora read and cleaned, Megatron .bin/.idx, preparation, chat data, samples, plans"""
