"""Holds the lock of a run directory for a minute, for tests/test_rundir.py: prints `locked` once it has it.

python tests/support/hold_run_dir.py RUN_DIR
"""

import sys
import time
from pathlib import Path

from areal_hpc.rundir import Holder, lock_run_dir

lock_run_dir(Path(sys.argv[1]), Holder.this_process(), lambda job: None)
print("locked", flush=True)
time.sleep(60)
