"""The start-up timer moved to vllm/utils/startup_timer.py (the engine and utils use it, not
only compilation); these names stay importable from here for older callers."""
from vllm.utils.startup_timer import (  # noqa: F401
    CPU_KERNEL_BUILD,
    OTHER,
    STANDARD_PHASES,
    StartupTimer,
    get_startup_timer,
    reset_startup_timer,
)
