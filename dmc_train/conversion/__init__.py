"""Checkpoint conversions (GQA today; Hugging Face import/export next)."""
