"""postrl: RL post-training of language models."""

__version__ = "0.2.0"
