"""Helpers for the tests and the GPU check (tools/gpu_check.py, tools/bench_export.py), not used by a run.

The CPU tests and the GPU check call the same functions, on the device of `trainer.spawn.default_device()`,
so a GPU check that passes ran the code that the CPU tests prove.

inputs         the checks' tiny models, random TrainBatches and probe sequences
compare        results compared: largest differences, and what is wrong as sentences
trainer_runs   what every trainer rank runs in a check (under spawn.run_ranks); transformers' reference logits
generator_runs an engine interrupted by weight loads mid-generation, held to transformers' logprobs;
               a runner's episodes pumped to the end (run_episodes)
runs           whole runs (`areal-hpc run`) started, stopped, resumed, and judged from their metrics
generator_log  what a generator's log says: vLLM's resolved settings, the engine's start time
gpu_checks     the GPU check's checks of a run's path (tools/gpu_check.py), each PASS, FAIL or SKIP
"""
