"""vLLM on a CPU host whose processes must ask for AMX: a worker extension that asks.

Linux lets a process use AMX's tile registers only after it asks
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``). PyTorch asks before its own AMX kernels run; vLLM 0.32's
CPU attention picks its AMX kernel from the CPU's flags alone
(``torch.cpu._is_amx_tile_supported()``, bfloat16, a block size that is a multiple of 32) and
does not ask. On such a host (seen here: a 2-core x86 VM whose Xeon reports ``amx_tile``,
kernel 6.18) vLLM's model worker dies on its first step: ``Worker proc VllmWorker-0 died
unexpectedly (exit code: -4)``, SIGILL, bare vLLM as much as through prefixgate.

Pass ``worker_extension_cls=AMX_WORKER_EXTENSION`` in vLLM's engine arguments (or
``--worker-extension-cls`` to its server): vLLM imports this module in each worker before the
model runs, and importing it asks. Where there is no AMX, or nothing to ask, it does nothing.

Example::

    from vllm import AsyncEngineArgs
    from prefixgate import VllmEngine
    from prefixgate.vllm_amx import AMX_WORKER_EXTENSION

    engine = VllmEngine.from_engine_args(AsyncEngineArgs(
        model=..., enable_prefix_caching=True, worker_extension_cls=AMX_WORKER_EXTENSION))
"""

from __future__ import annotations

__all__ = ["AMX_WORKER_EXTENSION", "AmxPermission", "request_amx"]


def request_amx() -> bool:
    """Asks Linux to let this process use AMX (as PyTorch does before its own AMX kernels).

    Returns:
        Whether the process may use AMX now: ``False`` without PyTorch, on a CPU without AMX,
        or where the kernel refuses.
    """
    try:
        import torch
    except ImportError:
        return False
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    return bool(init()) if callable(init) else False


class AmxPermission:
    """A vLLM worker extension that adds nothing to the worker: vLLM imports it, with this
    module, in each worker before the model runs, and the import asks for AMX."""


AMX_WORKER_EXTENSION = f"{__name__}.{AmxPermission.__qualname__}"
"""``worker_extension_cls`` for vLLM's engine arguments: the qualified name of
:class:`AmxPermission`."""

request_amx()
