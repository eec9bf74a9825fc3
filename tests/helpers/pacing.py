"""The step sleep of the e2e helper scripts, which a test can switch off mid-run.

Why: a script's epoch must outlast every change of a test on a loaded machine, so the
steps after the test's last change are an idle tail; once the test touches the file
given as --fast-file (Job.hurry), the steps stop sleeping.
"""

import os
import time


def pause(step_time: float, fast_file: str | None) -> None:
    if step_time and not (fast_file and os.path.exists(fast_file)):
        time.sleep(step_time)
