"""ggml backend devices of the loaded library: local GPUs, and remote devices of llama.cpp's RPC backend.

llama-cpp-python does not bind ggml's device registry, so this module binds the few functions it needs
from the libggml that sits next to the libllama `llama_cpp` loaded (dlopen of the same file returns the
instance already loaded, so these are the devices llama.cpp itself sees).

RPC: `rpc_devices(["host:port", ...])` connects to `rpc-server` processes (llama.cpp's tools/rpc) and
returns their devices, to be passed to a model through `llama_model_params.devices`
(`LlamaContext(rpc_servers=...)`). Nothing is registered globally: a later model that does not name the
servers does not use them.
"""
from __future__ import annotations

import ctypes
import socket
import warnings
from typing import Sequence

from .library import LIB_PATH, _lib_file_name

# enum ggml_backend_dev_type (ggml-backend.h)
DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU, DEVICE_ACCEL, DEVICE_META = range(5)

_vp = ctypes.c_void_p
_lib = None


def _ggml() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(LIB_PATH.parent / _lib_file_name().replace("llama", "ggml")))  # libggml.so ...
        for name, args, res in (
                ("ggml_backend_dev_count", [], ctypes.c_size_t),
                ("ggml_backend_dev_get", [ctypes.c_size_t], _vp),
                ("ggml_backend_dev_type", [_vp], ctypes.c_int),
                ("ggml_backend_dev_name", [_vp], ctypes.c_char_p),
                ("ggml_backend_dev_description", [_vp], ctypes.c_char_p),
                ("ggml_backend_dev_backend_reg", [_vp], _vp),
                ("ggml_backend_reg_name", [_vp], ctypes.c_char_p),
                ("ggml_backend_reg_count", [], ctypes.c_size_t),
                ("ggml_backend_reg_get", [ctypes.c_size_t], _vp),
                ("ggml_backend_reg_by_name", [ctypes.c_char_p], _vp),
                ("ggml_backend_reg_get_proc_address", [_vp, ctypes.c_char_p], _vp),
                ("ggml_backend_reg_dev_count", [_vp], ctypes.c_size_t),
                ("ggml_backend_reg_dev_get", [_vp, ctypes.c_size_t], _vp)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _lib = lib
    return _lib


def devices() -> list[dict]:
    """Every device registered in ggml (the local ones): name, description, type, backend."""
    g = _ggml()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        reg = g.ggml_backend_dev_backend_reg(dev)
        out.append(dict(name=g.ggml_backend_dev_name(dev).decode(),
                        description=g.ggml_backend_dev_description(dev).decode(), type=g.ggml_backend_dev_type(dev),
                        backend=g.ggml_backend_reg_name(reg).decode(), ptr=dev))
    return out


def backends() -> list[str]:
    """The ggml backends this build registered: CPU, and CUDA, Metal, Vulkan, RPC ... where it was built with them."""
    g = _ggml()
    return [g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)).decode() for i in range(g.ggml_backend_reg_count())]


def check_offload(n_gpu_layers: int, main_gpu: int = 0, tensor_split=None, rpc_servers=None, stacklevel: int = 3) -> bool:
    """Whether offloaded layers have a device to go to: a local GPU (an integrated one too) or `rpc_servers`. Without
    one, GPU placement options that were given (n_gpu_layers, main_gpu, tensor_split) are a RuntimeWarning: llama.cpp
    would run the model on the CPU without a word."""
    if rpc_servers or any(d["type"] in (DEVICE_GPU, DEVICE_IGPU) for d in devices() if d["backend"] != "RPC"):
        return True
    given = [f"{name}={value!r}" for name, value, unset in (("n_gpu_layers", n_gpu_layers, 0), ("main_gpu", main_gpu, 0),
                                                          ("tensor_split", tensor_split, None)) if value != unset]
    if given:
        warnings.warn(f"{', '.join(given)}: llama.cpp finds no GPU to offload to (this build's backends: "
                      f"{', '.join(backends())}), so the model runs on the CPU; for a GPU build see the README's "
                      "\"Set up\" (CMAKE_ARGS=\"-DGGML_CUDA=ON\" bash scripts/setup.sh)", RuntimeWarning,
                      stacklevel=stacklevel)
    return False


def summary() -> dict:
    """The backends and devices of this build, for `sfi-gguf info`."""
    from .library import llama_cpp

    return {"backends": backends(), "devices": [f"{d['name']} ({d['backend']}): {d['description']}" for d in devices()],
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}


def gpu_count() -> int:
    """Local GPUs llama.cpp can offload to (0 with a CPU-only build)."""
    return sum(1 for d in devices() if d["type"] == DEVICE_GPU and d["backend"] != "RPC")


def has_rpc() -> bool:
    """Whether the loaded library was built with the RPC backend (GGML_RPC=ON)."""
    return bool(_ggml().ggml_backend_reg_by_name(b"RPC"))


def _check_endpoint(endpoint: str, timeout: float) -> None:
    """Refuse an endpoint llama.cpp could not reach: its RPC client aborts the process on a failed connect."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"rpc_servers: {endpoint!r} is not host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(f"rpc_servers: cannot connect to the rpc-server at {endpoint} ({exc})") from None


def rpc_devices(endpoints: Sequence[str], timeout: float = 5.0) -> list[int]:
    """The devices (ggml_backend_dev_t pointers) of the rpc-server at each endpoint, in order."""
    g = _ggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise ValueError("rpc_servers: this llama.cpp build has no RPC backend; build it with -DGGML_RPC=ON "
                         "(scripts/rpc_check.sh builds one) and point SFI_GGUF_LIB_DIR at it")
    add_server = ctypes.CFUNCTYPE(_vp, ctypes.c_char_p)(
        g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server"))
    out = []
    for endpoint in endpoints:
        _check_endpoint(endpoint, timeout)
        server = add_server(endpoint.encode())
        if not server:
            raise ConnectionError(f"rpc_servers: the rpc-server at {endpoint} has no devices")
        out += [g.ggml_backend_reg_dev_get(server, i) for i in range(g.ggml_backend_reg_dev_count(server))]
    return out


def model_devices(rpc_servers: Sequence[str]) -> ctypes.Array:
    """NULL-terminated ggml_backend_dev_t array for llama_model_params.devices: the RPC devices first,
    then the local GPUs, or an integrated GPU where there is none (llama.cpp's own choice when it picks
    the devices itself)."""
    local = [d for d in devices() if d["backend"] != "RPC"]
    gpus = [d["ptr"] for d in local if d["type"] == DEVICE_GPU]
    devs = rpc_devices(rpc_servers) + (gpus or [d["ptr"] for d in local if d["type"] == DEVICE_IGPU][:1])
    return (_vp * (len(devs) + 1))(*devs, None)
