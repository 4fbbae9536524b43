"""The weight sync: after each optimizer step the trainer's pipeline-stage sources broadcast the new
weights, under their Hugging Face names, to every generator engine (NCCL on GPUs, gloo on CPUs).

`group` is one process group between a source and the engines' workers (its start-up check, timeouts,
device); `broadcast` is what travels on the groups (buckets, order, the sender and the receiver). The
loading side, inside vLLM's workers, is areal_hpc.generator.weight_loader.
"""
