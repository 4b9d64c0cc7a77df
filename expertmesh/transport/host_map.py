"""Host shared memory seen from a GPU: the coordinator's end of a host link.

A host link (expertmesh/transport/link.py's areas, in the shared-memory segment a CPU expert
server maps too) is written and polled by the coordinator's decode graph: the hidden states,
slot ids and weights of each MoE layer go straight from the GPU into the request area over
PCIe, the flag kernel publishes them, and the wait kernel polls the answer area's flag. For
that, the areas must be pinned *and mapped* into the GPU's address space (a copy would go
stale: the server writes the answer area while the graph runs), and the graph needs them as
CUDA tensors.

Registration works on whole pages: the range registered is the pages spanning the areas (a
mapping of a file always covers its last page whole). Unregister with :meth:`HostMapped.close`
before the memory goes; it synchronises the device first, so no kernel still reads it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from expertmesh.transport import cuda_ipc

_PAGE = 4096
# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: pinned for every context of this
# process and mapped into the device's address space
_FLAGS = 1 | 2


@functools.cache
def _device_pointer() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class HostMapped:
    """``host`` (a uint8 CPU tensor over shared memory) as a uint8 tensor on ``device``
    aliasing the same bytes (:attr:`tensor`)."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        if host.is_cuda or host.dtype != torch.uint8 or not host.is_contiguous() or host.numel() == 0:
            raise ValueError("host mapping needs a non-empty contiguous uint8 CPU tensor")
        device = cuda_ipc.indexed(device)
        ptr, n = host.data_ptr(), host.numel()
        start = ptr - ptr % _PAGE
        end = -(-(ptr + n) // _PAGE) * _PAGE
        drv = cuda_ipc._driver(device)
        drv.check(drv.host_register(start, end - start, _FLAGS), "cuMemHostRegister")
        self._start, self._device, self._host = start, device, host
        try:
            dptr = ctypes.c_uint64()
            drv.check(_device_pointer()(ctypes.byref(dptr), start, 0), "cuMemHostGetDevicePointer")
            self.tensor = cuda_ipc.wrap(dptr.value + (ptr - start), n, device)
        except Exception:
            drv.check(drv.host_unregister(start), "cuMemHostUnregister")
            raise

    def close(self) -> None:
        if self._start:
            del self.tensor
            drv = cuda_ipc._driver(self._device)  # synchronises first: no kernel reads it still
            drv.check(drv.host_unregister(self._start), "cuMemHostUnregister")
            self._start = 0
