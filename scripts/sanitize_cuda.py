"""Every conformance case on the CUDA backend, for compute-sanitizer: odd D and Dh, GQA/MQA,
partial rotary, strided views, every modulation form, every launch class of the row kernels.
Exits 1 if a case fails. Usage:
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py
  compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py --dtypes bfloat16
--streaming-stores runs the rotary kernel's streaming-store copy on every call: the cases are
short calls, which the launch table keeps on the plain stores.
"""

import argparse
import sys
from collections import Counter

import torch

from ditops import conformance
from ditops.backends import compiled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", help="only these ops")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--streaming-stores", action="store_true", help="the rotary kernel's streaming stores on every call")
    arguments = parser.parse_args()
    if arguments.streaming_stores:
        settings = compiled._launch_settings()
        settings = {**settings, "rotary": {**settings["rotary"], "streaming_stores": {"min_tokens": 0, "max_tokens": 2**62}}}
        compiled._launch_settings = lambda: settings
    counts = Counter()
    for case in conformance.CASES + conformance.LONG_CASES:
        if arguments.ops and case.op not in arguments.ops:
            continue
        for dtype in (getattr(torch, name) for name in arguments.dtypes):
            outcome = conformance.run_case(case, "cuda", dtype, "cuda")
            counts[outcome.status] += 1
            if outcome.status == "fail":
                print(f"FAIL {case.id} {dtype}: {outcome.detail}")
    torch.cuda.synchronize()
    print(f"cuda under the sanitizer: {counts['pass']} passed, {counts['skip']} refused (other backends serve them), "
          f"{counts['fail']} failed")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
