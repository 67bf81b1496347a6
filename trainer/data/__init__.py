"""Training data: sources and local files, the builtin corpus, direction sampling, tokenization with its cache, batching."""
