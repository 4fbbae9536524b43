"""The trainer ranks (Megatron-core): Qwen2/Qwen3 from Hugging Face, TP x PP x DP, the decoupled PPO step.

cpu_compat   megatron-core's CUDA-only calls routed to the CPU (only when CUDA is absent)
cuda_allocator  expandable segments for a trainer rank's CUDA caching allocator, before it allocates
model        Qwen2/Qwen3 architecture -> Megatron TransformerConfig and this rank's GPTModel stage
packed       packed rows: sequences sharing a row, attention within each, per-sequence positions
logprobs     token logprobs and entropy from the last stage's hidden states, a chunk of logits at a time
convert      Hugging Face tensors <-> a rank's Megatron shard; per-stage export stream
engine       torch.distributed + parallel state, DDP model, optimizer, forward/backward schedule
step         the PPO step over a TrainBatch (prox recompute, minibatches, stats)
export       a checkpoint -> a Hugging Face directory (sharded safetensors), on one CPU process
worker       `serve(ctx, sync)`: the rank's message loop
spawn        N local ranks in processes of their own (tests, benchmarks, export)

The trainer settings a config names (recompute, prox_logp, lr_decay) are areal_hpc.config.choices.
Its checkpoints (Megatron dist_checkpointing of model + optimizer, any TP/PP/DP) are
`areal_hpc.trainer.checkpoint`; the checks that the CPU tests assert and tools/gpu_check.py reports are in
`tests.support`.
"""
