"""Generator ranks: one interruptible vLLM engine each (`engine.GenerationEngine`), served over MPI
by `worker.serve(ctx, sync)`."""
