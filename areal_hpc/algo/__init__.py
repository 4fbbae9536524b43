"""The algorithm core: small pure pieces the controller and the trainer build on.

- `ppo`: the policy losses in the decoupled form of the AReaL paper (Eq. 5: `decoupled_ppo_loss`; GSPO,
  CISPO) and how token losses are aggregated, for the trainer.
- `advantages.group_advantages`: GRPO group-normalised advantages, for the controller.
- `staleness.StalenessGate`: the admission gate and consumption check that bound policy staleness.

The micro-batch packer lives beside them in `areal_hpc.packing`. None of these needs MPI or a GPU;
`advantages`, `losses`, `staleness` and `packing` do not import torch.
"""
