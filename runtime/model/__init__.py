"""Model loading (GGUF, HF folders), layers, attention and the model runner."""
