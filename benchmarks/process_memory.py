"""A benchmark worker's own resident memory: its peak, and what it holds not file-backed."""
from __future__ import annotations

import resource


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def anon_rss_mb() -> float | None:
    """This process's resident memory now that no file backs (RssAnon, MB): what it holds
    itself, without the pages of files it maps (a checkpoint being loaded, a mapped GGUF)."""
    return _status_mb("RssAnon")


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB) since it started its program, pages of mapped
    files included (a checkpoint read through mmap while it loads). Not getrusage's
    ru_maxrss: Linux carries that across exec from the forked parent (a benchmark's own
    process, a few GB after converting checkpoints), so every worker read at least that."""
    peak = _status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
