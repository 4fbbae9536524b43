"""Helpers for the tests and the GPU check (tools/gpu_check.py, tools/bench_export.py), not used by a run.

The CPU tests and the GPU check call the same functions, on the device of `trainer.spawn.default_device()`,
so a GPU check that passes ran the code that the CPU tests prove.

inputs         the checks' tiny models, random TrainBatches and probe sequences
compare        results compared: largest differences, and what is wrong as sentences
trainer_runs   what every trainer rank runs in a check (under spawn.run_ranks); transformers' reference logits
"""
