"""automodel: fine-tune Hugging Face causal LMs on long sequences with context parallelism."""

__version__ = "0.1.0"
