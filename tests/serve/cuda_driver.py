"""A client's device memory for the CUDA shared-memory tests of `hearth
serve`: the CUDA driver's few calls (ctypes, no torch) that allocate it,
copy to and from it and export it by IPC handle. libcuda is opened when a
Cuda is made, not when this module is imported.
"""

import ctypes

import numpy as np


class Cuda:
    """The few driver calls a client needs: device memory, copies, IPC handles."""

    def __init__(self, ordinal=0):
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, p, i = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t]
        self.lib.cuMemFree_v2.argtypes = [u64]
        self.lib.cuMemcpyHtoD_v2.argtypes = [u64, p, ctypes.c_size_t]
        self.lib.cuMemcpyDtoH_v2.argtypes = [p, u64, ctypes.c_size_t]
        self.lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, u64]
        self.lib.cuDeviceGet.argtypes = [ctypes.POINTER(i), i]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(p), i]
        self.lib.cuCtxSetCurrent.argtypes = [p]
        self.check(self.lib.cuInit(0), "cuInit")
        dev = i()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        ctx = p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def check(result, what):
        if result != 0:
            raise RuntimeError(f"{what}: CUDA error {result}")

    def alloc(self, nbytes):
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), "cuMemAlloc")
        return ptr.value

    def free(self, ptr):
        self.lib.cuMemFree_v2(ptr)

    def put(self, ptr, array):
        array = np.ascontiguousarray(array)
        self.check(self.lib.cuMemcpyHtoD_v2(ptr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")

    def get(self, ptr, nbytes):
        out = np.empty(nbytes, np.uint8)
        self.check(self.lib.cuMemcpyDtoH_v2(out.ctypes.data, ptr, nbytes), "cuMemcpyDtoH")
        return out

    def handle(self, ptr):
        h = ctypes.create_string_buffer(64)
        self.check(self.lib.cuIpcGetMemHandle(h, ptr), "cuIpcGetMemHandle")
        return h.raw
