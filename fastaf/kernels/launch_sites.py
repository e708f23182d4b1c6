"""Cheap repeated launches of a Triton kernel: skip ``JITFunction.run``'s per-call bookkeeping.

``kernel[grid](*args, **meta)`` binds every argument, asks Triton's ``specialize_impl`` about
each one and builds a cache key before it reaches the compiled launcher: ~27 us of host time
per launch on the H200 machine (triton 3.6), against ~10 us for the compiled launcher alone and
15-23 us for a cuBLAS call; through a ``LaunchSite`` a launch costs ~14 us. A
``LaunchSite`` does the normal launch the first time per specialization, keeps the returned
``CompiledKernel``, and later calls its launcher directly, as ``JITFunction.run`` itself does:

    compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, enter_hook, exit_hook, *all_kernel_args)

The site's key is finer than Triton's specialization, so a hit always maps to the kernel Triton
would have picked: per tensor its dtype and whether ``data_ptr() % 16 == 0``; every int argument
by value (Triton specializes ints on == 1, % 16 == 0 and the i32 / i64 range); floats
not at all (Triton never specializes them; the launchers pass Python floats); and
the meta-parameters (constexprs, num_warps, num_stages) and the current device. Registered launch
hooks (profilers: a non-empty ``knobs.runtime.launch_enter_hook`` chain) and the interpreter
(TRITON_INTERPRET=1) take the normal path; otherwise the launcher gets None for the hooks,
which it skips (an empty chain is still a call into Python per launch). If the fast path fails
once (attribute missing, different calling convention), the site warns once and uses the normal
launch from then on.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import torch

from fastaf import _config

try:  # triton >= 3.4 keeps the launch hooks in knobs.runtime
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton: normal launches only
    _knobs = None
# what triton's own driver uses for the current stream (a raw handle, no Stream object)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# torch.cuda.current_device() less its lazy-init check (a launch follows CUDA tensors: initialised)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def hook_active(hook: Any) -> bool:
    """A launch hook that would run: triton 3.6+ keeps a (usually empty) HookChain, older ones None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_active() -> bool:
    """A launch hook (a profiler's) would run: launches take Triton's normal path, never a cached
    kernel or a CUDA graph of fastaf's, which would skip it."""
    runtime = _knobs.runtime
    return hook_active(runtime.launch_enter_hook) or hook_active(runtime.launch_exit_hook)


def fast_launch_enabled() -> bool:
    if _knobs is None or _raw_stream is None:
        return False
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and _config.flags().fast_launch


class LaunchSite:
    """One kernel's launches with the compiled kernels cached under a cheap key.

    The kernel's parameters must come in the fastaf signature order: ``n_ptr`` tensors, then
    ``n_int`` ints (sizes, strides), then float scalars, then the constexprs (meta). ``args`` are
    the runtime arguments in order and ``meta`` the constexprs plus num_warps / num_stages.
    """

    def __init__(self, kernel: Any, n_ptr: int, n_int: int) -> None:
        self.kernel = kernel
        self.n_ptr, self.n_int_end = n_ptr, n_ptr + n_int
        self.compiled: dict[tuple, tuple] = {}
        self.fast = fast_launch_enabled()
        self.hits = 0  # fast launches so far (tests check that the fast path ran)
        try:
            params = kernel.params
            flags = [p.is_constexpr for p in params]
            self.n_runtime = flags.index(True) if True in flags else len(flags)
            self.constexpr_names = tuple(p.name for p in params[self.n_runtime:])
            if not all(flags[self.n_runtime:]):
                raise TypeError("constexpr parameters are not all after the runtime ones")
        except Exception as err:  # noqa: BLE001 - any surprise disables the fast path only
            self._disable(err)

    def layout_ok(self, args: Sequence[Any]) -> bool:
        """args are n_ptr tensors, then n_int ints, then floats only (the key's assumption)."""
        ok = (all(isinstance(t, torch.Tensor) for t in args[:self.n_ptr])
              and all(type(v) is int for v in args[self.n_ptr:self.n_int_end])
              and all(type(v) is float for v in args[self.n_int_end:]))
        if not ok:
            self._disable(TypeError("arguments are not n_ptr tensors, n_int ints, then floats"))
        return ok

    def _disable(self, err: BaseException) -> None:
        if self.fast:
            name = getattr(getattr(self.kernel, "fn", None), "__name__", "kernel")
            warnings.warn(f"fastaf: fast Triton launch disabled for {name} ({type(err).__name__}: {err}); "
                          "using the normal launch", RuntimeWarning, stacklevel=3)
        self.fast = False

    def __call__(self, grid: Sequence[int], args: Sequence[Any], meta: dict, meta_key: tuple) -> tuple | None:
        """Launch over ``grid`` (1-3 ints). ``meta_key`` is a hashable stand-in for ``meta``.

        Returns the cached kernel it launched, (device, compiled, tail), when it took the fast
        path: ``again`` relaunches it for a call its caller knows to be alike. Else None.
        """
        if not self.fast:
            self.kernel[tuple(grid)](*args, **meta)
            return None
        device = _current_device()
        # exact int values (finer than Triton's ==1 / %16 / i32-i64 classes, and cheaper to build
        # than a per-argument classification), tensors by dtype and 16-byte alignment
        key = (device, meta_key, args[self.n_ptr:self.n_int_end],
               *[(t.dtype, t.data_ptr() & 15 == 0) for t in args[:self.n_ptr]])
        entry = self.compiled.get(key)
        if entry is None:
            compiled = self.kernel[tuple(grid)](*args, **meta)
            if not self.layout_ok(args):  # never cache a call the key does not describe
                return None
            try:
                tail = tuple(meta[name] for name in self.constexpr_names)
                compiled.run  # noqa: B018 - loads the module; raises here, not mid-launch, if absent
                self.compiled[key] = (device, compiled, tail)
            except Exception as err:  # noqa: BLE001
                self._disable(err)
            return None
        if not self.again(entry, grid, args, device):
            self.kernel[tuple(grid)](*args, **meta)  # a profiler's hook, or the fast path failed
            return None
        return entry

    def again(self, entry: tuple, grid: Sequence[int], args: Sequence[Any], current: int | None = None) -> bool:
        """Launch ``entry`` (what ``__call__`` returned) with ``args`` and no key: the caller vouches
        that the call is alike (argument dtypes, alignments and ints, meta-parameters). False,
        launching nothing, when it cannot: a launch hook is active (profilers want launch
        metadata: the normal path), another current device, or the fast path failed.
        ``current``: the current device where the caller read it already."""
        device, compiled, tail = entry
        if not self.fast or _hooks_active() or (_current_device() if current is None else current) != device:
            return False
        try:
            stream = _raw_stream(device)
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            # no hook runs: None spares the launcher two calls into Python (the empty chains)
            compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *tail)
            self.hits += 1
            return True
        except Exception as err:  # noqa: BLE001
            self._disable(err)
            return False
