"""GGUF (llama.cpp's file format) to an mxc model directory: the file, its architectures, its tokenizer."""
