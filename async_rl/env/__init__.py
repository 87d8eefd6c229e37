"""The world a multi-turn episode talks to: the env interface users write (`rollout.env`: a factory
of objects with `max_turns` and `step(key, messages, state)`), stable per-step keys, checked step
results, running env steps off the generation thread with bounds in number and time, and the MCP
tools env. The built-in tool tasks and the tool-call format live in `data`."""
