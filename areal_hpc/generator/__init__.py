"""Generator ranks: one interruptible vLLM engine each (`engine.GenerationEngine`, which samples turns),
the workflow's episodes next to it (`episodes.EpisodeRunner`), served over MPI by `worker.serve(ctx, sync)`."""
