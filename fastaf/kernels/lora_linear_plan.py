"""LoRA linear's launch planning: the config, grid and meta-parameters of a launch, and which
implementation ``impl="auto"`` runs.

``launch_config`` takes a launch's config from an override, the tuning cache (``cache``) or the
defaults (``lora_linear_configs``), fitted to shared memory. ``_plan`` memoizes a launcher's
whole plan (grid, meta-parameters) per shape, and ``choose_impl`` the dispatch choice
(``dispatch``): the launchers run per layer per step, and a repeated shape costs a dict
lookup. ``clear_memos`` forgets all of them after the tuning cache changed. Under
``torch.use_deterministic_algorithms(True)`` ``choose_impl`` sends every backward to cuBLAS: the
Triton backward reduces with fp32 atomics.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from fastaf import _config
from fastaf.kernels import cache, dispatch
from fastaf.kernels.hardware import _device_info, _hopper, available, smem_limit
from fastaf.kernels.lora_linear_configs import (DEFAULTS, DEFAULTS_FP32, INTERPRET, MAX_RANK, _INTERPRET_PROGRAMS,
                                                config_problem, fit, fit_smaller)


def padded_rank(r: int) -> int:
    """tl.dot's minimum of 16, else the next power of two (plain ints: triton.next_power_of_2 is a
    constexpr function in triton 3.6, a few us per host call)."""
    return max(16, 1 << (r - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit operands


def _key(**kw: Any) -> dict:
    return {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v) for k, v in kw.items()}


def gemm_key(M: int, N: int, K: int, R: int, dtype: torch.dtype, w_kn: torch.Tensor) -> dict:
    """Cache key of the gemm; ``layout`` tells w's unit-stride dim ("nk": K, as weight.T in forward)."""
    return _key(M=M, N=N, K=K, R=R, dtype=dtype, layout="nk" if w_kn.stride(0) == 1 else "kn")


_config_memo: dict[tuple, dict] = {}
_choice_memo: dict[tuple, str] = {}
_plan_memo: dict[tuple, tuple] = {}
# a launcher's whole plan and launched kernel per call signature (shapes, strides, dtypes, flags
# of 16-byte-aligned operands): [grid, ..., LaunchSite entry or None], one lookup per launch
call_memo: dict[tuple, list] = {}


_MEMOS: list[dict] = []  # other kernel families' plan memos built from launch_config (lora_multi's)


def clear_memos() -> None:
    """Forget memoized configs, launch plans and dispatch choices (after the tuning cache changed)."""
    _config_memo.clear()
    _choice_memo.clear()
    _plan_memo.clear()
    call_memo.clear()
    from fastaf.kernels import launch_graphs  # launch_graphs captured with the old configs: captured anew

    launch_graphs.GRAPHS.clear()
    for memo in _MEMOS:
        memo.clear()
    cache.forget()


def launch_config(phase: str, device: torch.device, key: dict, override: Optional[dict] = None) -> dict:
    """Override, else the tuning cache's nearest entry, else the default for ``phase``.

    A cached config may predate a meta-parameter (USE_TMA, DB_PARTIAL): the default fills it in.
    A cached config tuned at another shape may not fit this one's shared memory (``fit``): its
    stages are lowered, else the default (fitted the same way) is used.
    """
    if override is not None:
        return override
    if device.type != "cuda":
        return INTERPRET["gemm" if phase == "gemm_plain" else phase]
    if key.get("dtype") == "float32" and phase.startswith("gemm"):
        phase_default = DEFAULTS_FP32[phase]
    else:
        phase_default = DEFAULTS[phase]
    memo_key = (phase, device.index, tuple(sorted(key.items())))
    conf = _config_memo.get(memo_key)
    if conf is None:
        entry = cache.lookup("kernels", f"lora_linear.{phase}", key)
        conf = entry["config"] if entry is not None and isinstance(entry.get("config"), dict) else phase_default
        # the default's keys exactly: it fills in a meta-parameter the entry predates, and a key
        # this version's kernel does not take (a cache from another fastaf) is dropped
        conf = {k: conf.get(k, v) for k, v in phase_default.items()}
        problem = config_problem(conf)
        if problem is not None:  # memoized below: one warning per phase and shape
            warnings.warn(f"fastaf: ignoring the tuning cache's lora_linear.{phase} config for "
                          f"{key}: {problem}; using the default", stacklevel=2)
            conf, entry = dict(phase_default), None
        if entry is None or entry.get("key") != key:  # borrowed from another shape: may not fit this one
            sizes = dict(r_pad=padded_rank(key.get("R", 1)), elt=_elt(key.get("dtype")), limit=smem_limit(device))
            conf = (fit(phase, conf, **sizes) or fit(phase, phase_default, **sizes)
                    or fit_smaller(phase, phase_default, **sizes) or phase_default)
        _config_memo[memo_key] = conf
    return conf


def _plan(memo_key: Optional[tuple], build) -> tuple:
    """Memoized launch plan (grid, meta, meta_key, ...) of one launcher; ``memo_key=None``: no memo."""
    if memo_key is None:
        return build()
    plan = _plan_memo.get(memo_key)
    if plan is None:
        plan = _plan_memo[memo_key] = build()
    return plan


def _call_plan(call: Optional[tuple], build, slots: int = 1) -> list:
    """The plan of a launcher's call with signature ``call`` (None: not memoized), made by
    ``build()`` on a miss and memoized with ``slots`` trailing places for the kernels launched."""
    plan = call_memo.get(call) if call is not None else None
    if plan is None:
        plan = [*build(), *(None,) * slots]
        if call is not None:
            call_memo[call] = plan
    return plan


def aligned(*tensors: Optional[torch.Tensor]) -> bool:
    """Every given tensor starts on a 16-byte boundary (what Triton specializes pointers on)."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    return bits & 15 == 0


def _meta(**meta: Any) -> tuple[dict, tuple]:
    """Kernel meta-parameters and their hashable key for the launch site."""
    return meta, tuple(meta.items())


def choose_impl(impl: str, phase: str, x: torch.Tensor, M: int, K: int, N: int, R: int) -> str:
    if impl == "triton":
        if not available(x):
            raise RuntimeError(f"lora_linear: impl='triton' needs a CUDA tensor or TRITON_INTERPRET=1, "
                               f"got x on {x.device}")
        if R > MAX_RANK:
            raise ValueError(f"lora_linear: the Triton path supports rank <= {MAX_RANK}, got {R}")
        if phase == "bwd":  # alerts in deterministic mode
            dispatch.atomics_ok(impl, lambda: f"lora_linear's backward at M={M}, K={K}, N={N}, R={R}")
        return "triton"
    if impl not in ("auto", "addmm"):
        raise ValueError(f"lora_linear: impl must be 'auto', 'triton' or 'addmm', got {impl!r}")
    if impl == "addmm" or not x.is_cuda or R > MAX_RANK:
        return "addmm"
    if phase == "bwd" and not dispatch.atomics_ok(impl, "lora_linear's backward"):
        # the Triton backward sums dA, dB and dh with fp32 atomics, in an order that changes from
        # run to run; cuBLAS's backward gives the same bits every run (torch's deterministic mode)
        return "addmm"
    forced = _config.flags().dispatch
    if forced != "measured":
        return forced
    # memoized: the cache lookup cost ~0.1 ms of host time per call, which doubled the
    # launch-bound M=2048 K=N=4096 forward (1.98x vs 1.21x base on H200)
    memo_key = (phase, x.device.index, M, K, N, R, x.dtype)
    choice = _choice_memo.get(memo_key)
    if choice is None:
        gpu = _device_info(x.device.index)[0]
        choice = dispatch.choose("lora_linear", phase, _key(M=M, K=K, N=N, R=R, dtype=x.dtype), gpu)
        _choice_memo[memo_key] = choice
    return choice


def _num_programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":
        return max(1, min(_INTERPRET_PROGRAMS, tiles))
    return max(1, min(_device_info(device.index)[1], tiles))


def _conf_key(config: Optional[dict]) -> tuple:
    return () if config is None else tuple(sorted(config.items()))


def _tf32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def _elt(dtype: torch.dtype | str | None) -> int:
    """Bytes per element of a kernel operand: a dtype, or a cache key's dtype name."""
    return 4 if dtype in (torch.float32, "float32") else 2


def _skinny_conf(phase: str, dev: torch.device, key: dict, config: Optional[dict], tma_ok: bool,
                 flags: tuple[str, ...] = ("USE_TMA",), factor: Optional[torch.dtype] = None
                 ) -> tuple[dict, bool, dict, bool]:
    """(config, whether its USE_TMA applies here, config less the launcher-decided ``flags``,
    whether the kernel may read the LoRA factor in its own dtype ``factor``).

    The tuning cache and the defaults fit shared memory with the factor tile as wide as x's
    (``key``'s dtype); an fp32 master factor beside 16-bit x doubles that tile, so the config's
    stages are lowered to fit it, and where even two stages overflow the factor must come in x's
    dtype (False: the launcher casts it, one small launch).
    """
    conf = launch_config(phase, dev, key, config)
    factor_fits = True
    elt = _elt(key["dtype"])
    if factor is not None and _elt(factor) > elt and config is None and dev.type == "cuda":
        fitted = fit(phase, conf, padded_rank(key["R"]), elt, smem_limit(dev), _elt(factor))
        conf, factor_fits = (fitted, True) if fitted is not None else (conf, False)
    tma = bool(conf.get("USE_TMA", 0)) and tma_ok and _hopper(dev)
    return conf, tma, {k: v for k, v in conf.items() if k not in flags}, factor_fits
