"""A one-line Triton kernel for the device probe (harness.runtime.device_probe): Triton resolves a
kernel's names from its module's globals, so it lives in a module that imports Triton at the top,
imported only where Triton is installed."""

import triton
import triton.language as tl


@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def launch(torch) -> None:
    """Compile the kernel and run it once on the current device."""
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)
    add[(triton.cdiv(x.numel(), 1024),)](x, x, out, x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
