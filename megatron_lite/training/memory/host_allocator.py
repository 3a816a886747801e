"""glibc malloc settings for training whose activations live in host memory (CPU runs).

Every microbatch allocates and frees the same large tensors (the logits, their softmax, the MLP's
activations). glibc's defaults hand such blocks back to the kernel when they are freed at the top of
the heap (trimming) or were mmap'ed, so the next microbatch's copy faults in fresh pages the kernel
zeroes first: measured on pretrain.py's last pipeline stage (8 layers, hidden 256, vocab 8192, pp 4),
5-23 thousand page faults and 26-59 ms of kernel time per iteration, on the stage every other one
waits for.
Keeping freed blocks in the process turns that into reuse: the same job faults a few pages per
iteration. Only where the memory goes changes, never a value: losses stay bitwise identical.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): blocks up to it come from
# the heap and are reused; larger ones are still mmap'ed (their page faults are few beside their
# matmuls' work).
MMAP_THRESHOLD = 32 * 1024 * 1024
# Free memory at the heap's top is handed back only beyond this: one iteration's peak is reused by
# the next, so giving it back buys nothing but the next iteration's page faults.
TRIM_THRESHOLD = 1024 * 1024 * 1024
SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def keep_freed_host_memory() -> bool:
    """Tell this process's glibc malloc to keep freed blocks for reuse (fixed mmap and trim
    thresholds instead of glibc's sliding ones). Returns whether it was applied: False on other C
    libraries (macOS, musl), where nothing changes. The process's resident memory then stays near
    its peak between iterations instead of falling back; the peak itself is what the job needs."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success, 0 for a value glibc refuses.
    applied = [libc.mallopt(param, value) for param, value in SETTINGS]
    return all(applied)
