"""The JSON summary of the reliability and fuzz tests (tests/test_gpu_reliability.py, tests/test_fuzz.py)."""

import fcntl
import json
import os


def record(section: str, data) -> None:
    """Merges ``{section: data}`` into the JSON file named by DITOPS_RELIABILITY_OUT, if set."""
    path = os.environ.get("DITOPS_RELIABILITY_OUT")
    if not path:
        return
    with open(path + ".lock", "w") as lock:  # pytest-xdist workers write the same file
        fcntl.flock(lock, fcntl.LOCK_EX)
        summary = {}
        if os.path.exists(path):
            with open(path) as file:
                summary = json.load(file)
        summary[section] = data
        with open(path, "w") as file:
            json.dump(summary, file, indent=2, sort_keys=True)
