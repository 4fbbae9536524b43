"""The trainer ranks (Megatron-core): Qwen2/Qwen3 from Hugging Face, TP x PP x DP, the decoupled PPO step.

cpu_compat   megatron-core's CUDA-only calls routed to the CPU (only when CUDA is absent)
model        Qwen2/Qwen3 architecture -> Megatron GPTModel stage; packed rows (block-diagonal mask, positions)
convert      Hugging Face tensors <-> a rank's Megatron shard; per-stage export stream
engine       torch.distributed + parallel state, DDP model, optimizer, forward/backward schedule
step         the PPO step over a TrainBatch (prox recompute, minibatches, stats)
checkpoint   Megatron dist_checkpointing of model + optimizer (any TP/PP/DP), with the model's HF files
export       a checkpoint -> a Hugging Face directory (sharded safetensors), on one CPU process
worker       `serve(ctx, sync)`: the rank's message loop
spawn        N local ranks in spawned processes (tests, benchmarks, export)
"""
