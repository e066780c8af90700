"""A benchmark worker's own peak resident memory."""
from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB) since it started its program. Not getrusage's
    ru_maxrss: Linux carries that across exec from the forked parent (a benchmark's own
    process, a few GB after converting checkpoints), so every worker read at least that."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
