"""What a device can run, decided before any work starts, with a message that says what to do instead."""

from __future__ import annotations

import torch

#: the first CUDA compute capability whose Triton has the float8 e4m3 type (``fp8e4nv``): Ada (sm_89), Hopper,
#: Blackwell. Triton's NVIDIA backend adds ``fp8e4nv`` to its supported fp8 types from 89 on; A100 (sm_80) and
#: older only have ``fp8e5`` and ``fp8e4b15``.
FP8_E4M3_MIN_CAPABILITY: tuple[int, int] = (8, 9)


def fp8_compile_blocker(device: torch.device | str) -> str | None:
    """Why ``quant="fp8"`` cannot run compiled on ``device`` (one sentence that says what to do instead), or None
    when it can.

    The FP8 row store casts to ``torch.float8_e4m3fn``; compiled on CUDA, Inductor generates Triton code for that
    cast, and Triton has no e4m3 type (``fp8e4nv``) below compute capability 8.9 (:data:`FP8_E4M3_MIN_CAPABILITY`),
    so the compile would fail deep inside Inductor on an A100. Eager decoding (``compile=False``) runs the cast in
    PyTorch and works on any GPU. Devices other than CUDA are never blocked here. Reads only
    ``torch.cuda.get_device_capability(device)``; it runs nothing on the device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= FP8_E4M3_MIN_CAPABILITY:
        return None
    need = "{}.{}".format(*FP8_E4M3_MIN_CAPABILITY)
    return (f"quant='fp8' with compile needs a GPU of compute capability {need} or newer (Ada, Hopper, Blackwell); "
            f"this GPU is sm_{major}{minor}, where Triton has no float8 e4m3 type (fp8e4nv) for the compiled step. "
            "Use quant='nvfp4' or quant='none' with compile, or keep quant='fp8' with compile=False")
