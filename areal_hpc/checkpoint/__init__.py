"""Checkpoints: one directory per saved policy version, written by both sides, trusted only once complete.

```
 RUN_DIR/checkpoints/step_<v>/
   trainer/            the trainer's model and distributed optimizer (Megatron dist_checkpointing, any
     hf/               TP x PP x DP), the model directory's other files, manifest.json written last
     manifest.json                                                                        trainer.py
   controller.pkl      the controller's state at v (controller.json: a summary)         controller.py
   in-flight-<r>.pkl   generator r's episodes in flight: their turns so far             in_flight.py
   FILES.json          every file's size and CRC-32                                      files.py
   COMPLETE            written last: only now does the checkpoint count                  files.py
```

files.py       where a checkpoint is, its file record, completion, the damage check, which one a run
               resumes from, which ones are kept (no torch: the controller and the launchers use it)
controller.py  the controller's side: a save from its `Save` messages to COMPLETE, off its event loop,
               and its own state
in_flight.py   the answers in flight: what each generator writes, what a resumed controller reads
trainer.py     the trainer's side: Megatron's dist_checkpointing of model + optimizer, written atomically
"""
