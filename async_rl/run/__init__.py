"""Putting it together: the factory that builds a run from a config, the train loop, evaluation, export
to Hugging Face format, and the command line."""
