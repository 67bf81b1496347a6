"""Checkpoints: sharded DCP save/load, the commit marker, resume rules, export to a Hugging Face model."""
