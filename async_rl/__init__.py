"""async_rl: asynchronous RL post-training for language-model policies on JAX.

Generation runs ahead of training; every prompt is trained exactly once per epoch,
even across kills and restarts. See README.md and docs/design.md.
"""

__version__ = "0.1.0"
