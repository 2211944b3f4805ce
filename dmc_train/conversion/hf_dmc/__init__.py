"""DMC models inside Hugging Face transformers: the self-contained modeling file shipped with a DMC export."""
