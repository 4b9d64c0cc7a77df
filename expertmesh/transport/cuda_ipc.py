"""CUDA IPC: one GPU buffer and one event shared with another process on the same GPU, or on
another GPU of the host that this one reaches by peer access (NVLink / PCIe P2P).

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

Another GPU's memory is mapped into this GPU's context (the driver enables peer access) and
wrapped as a tensor ON THIS GPU through a DLPack capsule: torch would place a view made from a
``__cuda_array_interface__`` on the GPU that owns the memory and copy it here once (stale data
forever). Two GPUs order their work with ``local`` (no event crosses between the devices).

Host memory shared with the other process (the fast path's segment) can be registered with the
driver (:func:`register_host`), so copies between it and a GPU are DMA without a staging copy.

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
        self.host_register = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
        self.host_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.host_unregister = lib.cuMemHostUnregister
        self.host_unregister.argtypes = [ctypes.c_void_p]
        self._error_string = lib.cuGetErrorString
        self._error_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in (
            self.get_handle,
            self.open_handle,
            self.close_handle,
            self.address_range,
            self.host_register,
            self.host_unregister,
        ):
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
    torch.cuda.synchronize(device)  # initialises the device's primary context
    torch.cuda.set_device(device)  # NOTE: the driver calls below act on this thread's current context
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


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLManagedTensor(ctypes.Structure):
    # DLPack's (unversioned) DLManagedTensor: DLTensor, then manager_ctx and deleter
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_DL_CPU, _DL_CUDA, _DL_UINT = 1, 2, 1


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    return libc


def wrap(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor ``[nbytes]`` on ``device`` aliasing memory at ``ptr`` (no copy, whichever
    GPU owns the memory: the caller makes sure ``device`` can address it)."""
    libc = _libc()
    size = ctypes.sizeof(_DLManagedTensor)
    # NOTE: one malloc block holds the struct and its shape/strides; torch frees it with
    # libc's free (the deleter) when the last view of the tensor goes
    block = libc.malloc(size + 16)
    if not block:
        raise MemoryError("malloc failed")
    dims = (ctypes.c_int64 * 2).from_address(block + size)
    dims[0], dims[1] = nbytes, 1  # shape [nbytes], stride 1
    m = _DLManagedTensor.from_address(block)
    kind = _DL_CUDA if device.type == "cuda" else _DL_CPU
    m.data, m.device = ptr, _DLDevice(kind, device.index or 0)
    m.ndim, m.dtype = 1, _DLDataType(_DL_UINT, 8, 1)
    m.shape, m.strides, m.byte_offset = block + size, block + size + 8, 0
    m.manager_ctx = None
    m.deleter = ctypes.cast(libc.free, ctypes.c_void_p).value
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return torch.utils.dlpack.from_dlpack(new(block, b"dltensor", None))


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
        t = wrap(base.value + offset, nbytes, device)
        if t.data_ptr() != base.value + offset or t.device != device:
            # NOTE: never a copy: it would serve stale data forever. Refuse (callers fall back).
            del t
            drv.check(drv.close_handle(base.value), "cuIpcCloseMemHandle")
            raise CudaIpcError(f"the shared memory could not be mapped on {device} without a copy")
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
    try:
        return torch.cuda.Event.from_ipc_handle(device, raw)
    except RuntimeError as e:  # torch's wrapper of the CUDA error
        raise CudaIpcError(f"cannot open the CUDA IPC event: {e}") from None


def peer_uuids(device: torch.device) -> tuple[str, ...]:
    """UUIDs of the other GPUs visible here whose memory ``device`` can address (peer access)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ()
    ours = indexed(device).index
    out = []
    for i in range(torch.cuda.device_count()):
        if i != ours and torch.cuda.can_device_access_peer(ours, i):
            out.append(str(getattr(torch.cuda.get_device_properties(i), "uuid", "")))
    return tuple(u for u in out if u)


def device_of(uuid: str) -> int | None:
    """The index of the visible GPU with this UUID (None: not visible here)."""
    for i in range(torch.cuda.device_count()):
        if str(getattr(torch.cuda.get_device_properties(i), "uuid", "")) == uuid:
            return i
    return None


_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: pinned for every context of this process


def register_host(t: torch.Tensor, device: torch.device) -> bool:
    """Pins host tensor ``t``'s memory (page-aligned, e.g. a shared-memory ring) for DMA from
    and to ``device``; False when the driver refuses (copies then stage through a bounce buffer,
    slower but the same result). Unpin with :func:`unregister_host` before the memory goes."""
    ptr, n = t.data_ptr(), t.nbytes
    if device.type != "cuda" or ptr % 4096 or n % 4096 or n == 0:
        return False
    try:
        drv = _driver(device)
    except CudaIpcError:
        return False
    return drv.host_register(ptr, n, _PORTABLE) == 0


def unregister_host(t: torch.Tensor, device: torch.device) -> None:
    drv = _driver(device)
    drv.check(drv.host_unregister(t.data_ptr()), "cuMemHostUnregister")


def indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device): IPC handles and events need an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
