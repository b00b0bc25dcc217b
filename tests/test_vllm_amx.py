"""The AMX worker extension: without it vLLM's CPU worker dies of SIGILL on a host that reports
AMX but has not granted it (every real-vLLM test here runs through it)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_the_extension_names_a_class_vllm_can_mix_into_its_worker() -> None:
    from prefixgate.vllm_amx import AMX_WORKER_EXTENSION, AmxPermission

    module, _, name = AMX_WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is AmxPermission
    # vLLM refuses an extension with an attribute its worker already has.
    assert [a for a in dir(AmxPermission) if not a.startswith("__")] == []


def test_importing_it_asks_for_amx_where_the_cpu_has_it() -> None:
    torch = pytest.importorskip("torch")
    # A process of its own: this one may have asked already.
    script = ("import ctypes, json; libc = ctypes.CDLL(None)\n"
              "def granted():\n"
              "    v = ctypes.c_ulong(); libc.syscall(158, 0x1022, ctypes.byref(v))  # ARCH_GET_XCOMP_PERM\n"
              "    return bool(v.value & (1 << 18))  # XTILEDATA\n"
              "before = granted(); import prefixgate.vllm_amx as m\n"
              "print(json.dumps([before, granted(), m.request_amx()]))")
    if not sys.platform.startswith("linux") or not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    before, after, again = __import__("json").loads(
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert (before, after, again) == (False, True, True)
