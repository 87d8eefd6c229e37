"""Prompts in, rewards out: the prompt dataset and its Grain iterator (epochs, shuffling, sharding),
record validation, the tokenizer and chat templates, the built-in tasks, and the reward functions that
score completions."""
