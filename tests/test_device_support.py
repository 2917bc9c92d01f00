"""polestar.device_support: quant='fp8' with compile is refused below sm_89, and that threshold is Triton's own."""

import pytest
import torch

from polestar.device_support import FP8_E4M3_MIN_CAPABILITY, fp8_compile_blocker


@pytest.mark.parametrize("capability, blocked", [((7, 0), True), ((8, 0), True), ((8, 6), True), ((8, 9), False),
                                                 ((9, 0), False), ((10, 0), False), ((12, 0), False)])
def test_fp8_compile_is_refused_below_sm89_with_one_clear_message(monkeypatch, capability, blocked):
    asked = []

    def capability_of(device=None):
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    message = fp8_compile_blocker("cuda:1")
    assert asked == [torch.device("cuda:1")]  # the capability of the device asked about, not the current one
    if not blocked:
        assert message is None
        return
    assert message.count(". ") == 1 and "\n" not in message  # one statement of the reason, one of what to do
    assert f"sm_{capability[0]}{capability[1]}" in message and "8.9" in message and "fp8e4nv" in message
    assert "quant='nvfp4'" in message and "compile=False" in message


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_other_devices_are_never_blocked_and_cuda_is_not_queried(monkeypatch, device):
    def no_cuda(device=None):
        raise AssertionError("a non-CUDA device must not query CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    assert fp8_compile_blocker(device) is None


def test_the_threshold_is_where_triton_gains_the_e4m3_type():
    """Triton's NVIDIA backend compiles a cast to float8 e4m3 (fp8e4nv) for sm_89 and sm_90 and refuses it for
    sm_80 and sm_86, ahead of time, without a GPU: the blocker's threshold is that one."""
    triton = pytest.importorskip("triton", reason="triton is not installed: the threshold is checked against it")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    def cast_to_e4m3(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(y_ptr.dtype.element_ty))

    # built directly (not by triton.jit, which gives an interpreter object under TRITON_INTERPRET=1)
    kernel = JITFunction(cast_to_e4m3)
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp8e4nv", "BLOCK": "constexpr"}

    def compiles(arch: int) -> bool:
        try:
            triton.compile(ASTSource(kernel, signature, {"BLOCK": 128}), target=GPUTarget("cuda", arch, 32))
        except Exception as e:  # triton.compiler.errors.CompilationError, caused by the unsupported type
            assert "fp8e4nv not supported" in str(e)
            return False
        return True

    threshold = FP8_E4M3_MIN_CAPABILITY[0] * 10 + FP8_E4M3_MIN_CAPABILITY[1]
    for arch in (80, 86, 89, 90):
        assert compiles(arch) == (arch >= threshold), arch


def test_the_compiled_step_refuses_fp8_below_sm89_before_any_work(monkeypatch):
    """A whole-step inductor compile refuses ``quant=fp8`` on an sm_80 GPU with the blocker's sentence, before
    anything is compiled or allocated; eager runs, other quantizers and ``compile=True`` (the layer regions alone on
    CUDA) are not refused."""
    import pytest
    import torch

    import polestar
    from polestar.step import StepRunner

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):  # a whole-step inductor graph
        StepRunner("inductor", torch.device("cuda"), polestar.assemble("polestar", {"quant": "fp8"}))
    StepRunner(False, torch.device("cuda"), polestar.assemble("polestar", {"quant": "fp8"}))
    StepRunner("inductor", torch.device("cuda"), polestar.assemble("polestar", {"quant": "nvfp4"}))
    # compile=True on CUDA compiles the layer regions alone: the quantizer runs uncompiled, nothing to refuse
    assert StepRunner(True, torch.device("cuda"), polestar.assemble("polestar", {"quant": "fp8"})).regions
