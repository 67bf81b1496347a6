"""Tokenizers: the SentencePiece vocabulary with language tags, its HF tokenizer.json form, the stock M2M100 form."""
