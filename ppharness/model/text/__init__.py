"""Text: a GGUF file's tokenizer as llama.cpp runs it (BPE with its pre-tokenizers, SentencePiece), its chat
template, and the tokens that end generation."""
