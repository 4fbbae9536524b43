"""The names of the policy losses and of their aggregations, without torch: the config lists and checks
them (`ppo.policy_loss`, `ppo.loss_agg`), `ppo` computes them (its docstring has the formulas)."""

POLICY_LOSSES = ("decoupled", "gspo", "cispo")
"""The values of `ppo.policy_loss`, each in its decoupled form (areal_hpc.algo.ppo.policy_token_losses)."""
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
"""The values of `ppo.loss_agg`: how token losses are averaged (areal_hpc.algo.ppo.aggregate)."""
