"""What this host's CPU offers the matmuls: its bf16 matrix instructions, from the kernel's CPU flags."""

from __future__ import annotations

BF16_MATRIX_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> set[str] | None:
    """The x86 CPU's feature flags from /proc/cpuinfo; None where there is no such file (not Linux) or
    no x86 ``flags`` line (aarch64 lists ``Features``: unknown here)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), None)
    except OSError:
        return None


def has_bf16_matrix_units() -> bool | None:
    """Whether oneDNN can run bf16 GEMMs in hardware here (AVX512-BF16 or AMX-BF16); None: unknown."""
    flags = cpu_flags()
    if flags is None:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags
