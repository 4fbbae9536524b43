"""Multi-turn rollout workflows: the episodes a generator runs, and the tools they call."""
