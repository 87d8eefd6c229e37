"""Training on finished rollouts: host batches laid out for the learner, the policy-gradient losses
(GRPO, PPO-style clipping, KL variants), and the jitted, sharded `train_step(state, batch)`."""
