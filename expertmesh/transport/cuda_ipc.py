"""CUDA IPC: one GPU buffer and one event shared with another process on the same GPU.

Memory is shared through the driver API (libcuda, present wherever a CUDA driver is), once per
stream for a whole ring, then addressed by offsets: opening a handle costs far more than a
layer's round trip, so nothing is opened per request. Events go through torch
(``Event(interprocess=True)``): one side records, the other waits for it.

How each side orders its GPU work after the other's (:data:`SYNC_MODES`): ``host`` (the
default) records an interprocess event and the other side's thread waits for it; ``stream``
queues a ``wait_event`` on the other side's GPU stream instead; ``local`` has each side finish
its own stream before it hands over, so no event crosses the process boundary. ``host`` was the
fastest of the three on an H200, by 20-40 us. All three pay the GPU's switch between the two
processes' contexts (about 0.3 ms per round trip without MPS; benchmarks/RESULTS.md).

NOTE: each side writes only GPU memory it allocated itself (the coordinator its hidden-state
ring, the server its output ring); the other side only reads. A stale or hung peer can then
never overwrite memory that its owner has reused.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

_LAZY_ENABLE_PEER_ACCESS = 1


SYNC_MODES = ("local", "host", "stream")


class CudaIpcError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    # NOTE: bytes, not c_char: a c_char array reads back cut at its first zero byte
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Driver:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaIpcError(f"no CUDA driver library: {e}") from None
        u64 = ctypes.c_uint64
        self.get_handle = lib.cuIpcGetMemHandle
        self.get_handle.argtypes = [ctypes.POINTER(_Handle), u64]
        self.open_handle = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        self.open_handle.argtypes = [ctypes.POINTER(u64), _Handle, ctypes.c_uint]
        self.close_handle = lib.cuIpcCloseMemHandle
        self.close_handle.argtypes = [u64]
        self.address_range = lib.cuMemGetAddressRange_v2
        self.address_range.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
        self._error_string = lib.cuGetErrorString
        self._error_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in (self.get_handle, self.open_handle, self.close_handle, self.address_range):
            f.restype = ctypes.c_int

    def check(self, result: int, what: str) -> None:
        if result != 0:
            s = ctypes.c_char_p()
            self._error_string(result, ctypes.byref(s))
            raise CudaIpcError(f"{what}: CUDA error {result} ({(s.value or b'?').decode()})")


@functools.cache
def _load() -> _Driver:
    return _Driver()


def _driver(device: torch.device) -> _Driver:
    drv = _load()
    torch.cuda.synchronize(device)  # makes the device's primary context current in this thread
    return drv


def share(t: torch.Tensor) -> dict:
    """What another process needs to map the memory of contiguous CUDA tensor ``t``."""
    assert t.is_cuda and t.is_contiguous(), f"{t.device=}"
    drv = _driver(t.device)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    drv.check(drv.address_range(ctypes.byref(base), ctypes.byref(size), t.data_ptr()), "cuMemGetAddressRange")
    h = _Handle()
    drv.check(drv.get_handle(ctypes.byref(h), base.value), "cuIpcGetMemHandle")
    return {"handle": bytes(h.reserved).hex(), "offset": t.data_ptr() - base.value, "nbytes": t.nbytes}


class _DeviceBuffer:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


@dataclass
class Mapped:
    """Another process's GPU memory, mapped here as a uint8 tensor (close it when done)."""

    tensor: torch.Tensor
    _base: int

    @classmethod
    def open(cls, info: dict, device: torch.device) -> Mapped:
        try:
            raw = bytes.fromhex(info["handle"])
            offset, nbytes = int(info["offset"]), int(info["nbytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise CudaIpcError(f"malformed CUDA IPC memory description: {e!r}") from None
        if len(raw) != 64 or offset < 0 or nbytes <= 0:
            raise CudaIpcError("malformed CUDA IPC memory description")
        drv = _driver(device)
        base = ctypes.c_uint64()
        h = _Handle()
        ctypes.memmove(ctypes.addressof(h), raw, len(raw))
        drv.check(drv.open_handle(ctypes.byref(base), h, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        t = torch.as_tensor(_DeviceBuffer(base.value + offset, nbytes), device=device)
        if t.data_ptr() != base.value + offset:
            # NOTE: memory of another GPU: torch placed the view on that GPU and as_tensor made a
            # one-time copy here, which would serve stale data forever. Refuse (callers fall back).
            del t
            drv.check(drv.close_handle(base.value), "cuIpcCloseMemHandle")
            raise CudaIpcError(f"the shared memory is not on {device}: mapping it here would copy it")
        return cls(t, base.value)

    def close(self) -> None:
        if self._base:
            dev = self.tensor.device
            del self.tensor
            drv = _driver(dev)  # synchronises first: no kernel of ours still reads the memory
            drv.check(drv.close_handle(self._base), "cuIpcCloseMemHandle")
            self._base = 0


def new_event(device: torch.device) -> tuple[torch.cuda.Event, str]:
    """An interprocess event on ``device`` and its handle (hex) for the other side."""
    with torch.cuda.device(device):
        ev = torch.cuda.Event(interprocess=True)
        ev.record()  # creates it on this device
        return ev, ev.ipc_handle().hex()


def open_event(handle: str, device: torch.device) -> torch.cuda.Event:
    try:
        raw = bytes.fromhex(handle)
    except (TypeError, ValueError):
        raise CudaIpcError("malformed CUDA IPC event handle") from None
    return torch.cuda.Event.from_ipc_handle(device, raw)


def indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device): IPC handles and events need an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
