"""LoRA linear's config spaces: what the tuner searches, the untuned defaults, and what fits.

A config is a plain dict (JSON-friendly for the tuning cache): the kernel's constexpr block sizes
plus num_warps / num_stages. ``smem_bytes`` and ``fit`` hold a config to shared memory at a padded
rank; ``config_problem`` rejects a cached config that cannot be launched. ``lora_linear_plan``
chooses among them; the kernels that take them are in ``lora_linear_kernels``.
"""
from __future__ import annotations

MAX_RANK = 256  # R_PAD > 256 leaves no registers for the (BLOCK_M, R_PAD) accumulators


def smem_bytes(phase: str, conf: dict, r_pad: int, elt: int, factor_elt: int = 0) -> int:
    """Shared memory a config of ``phase`` needs at padded rank ``r_pad``: the pipelined tiles.

    ``elt``: bytes per element of the activations (x, dy); ``factor_elt``: of the LoRA factor
    tile the kernel pipelines beside them (fwd_h's a, bwd_dy's b), when it differs (fp32 masters).
    The skinny kernels' tiles grow with R_PAD, so a config tuned at r=16 can overflow at r=64:
    fwd_h 64x256 with 4 stages takes 4 * (64*256 + 64*256) * 2 = 262144 bytes at R_PAD=64 (H100
    limit 232448), which a nearest-shape cache lookup can hand to an r=64 launch; fp32 factors
    (a's tile twice as wide) overflow the same way at r=48.
    """
    st = conf["num_stages"]
    felt = factor_elt or elt
    if phase in ("gemm", "gemm_plain"):
        # triton 3.6 keeps the out tile apart from the pipeline buffers: the default 128x256x64
        # 3-stage config took 213016 bytes on the H100, 3 * 49152 + 65536 (+ 24). gemm_plain
        # stores y from registers: counting its out tile too only errs on the safe side
        bm, bn, bk = conf["BLOCK_M"], conf["BLOCK_N"], conf["BLOCK_K"]
        return (st * (bm * bk + bk * bn) + bm * bn) * elt
    if phase == "fwd_h":
        return st * (conf["BLOCK_M"] * elt + r_pad * felt) * conf["BLOCK_K"]
    if phase == "bwd_dy":
        # An upper bound of what Triton 3.6 allocated on the H100 for 36 configs (r_pad 64-256,
        # bf16 and fp32 b), exact at some, at most 1.8x over:
        # num_stages - 1 buffers of the dy and b tiles, the fp32 (BLOCK_M, R_PAD) accumulator,
        # the db tile for the atomics. Counting b per stage with no accumulator passed r=128 to
        # launches that failed (245760 bytes).
        bm, bn = conf["BLOCK_M"], conf["BLOCK_N"]
        return (st - 1) * (bm * bn * elt + bn * r_pad * felt) + bm * r_pad * 4 + bn * r_pad * 6
    if phase == "bwd_da":
        return st * (conf["BLOCK_M"] * conf["BLOCK_K"] * elt + r_pad * conf["BLOCK_M"] * 4)  # dh tile is fp32
    return 0


def fit(phase: str, conf: dict, r_pad: int, elt: int, limit: int, factor_elt: int = 0) -> dict | None:
    """``conf`` with ``num_stages`` lowered (not below 2) until ``smem_bytes`` fits ``limit``.

    None when even 2 stages do not fit.
    """
    conf = dict(conf)
    while smem_bytes(phase, conf, r_pad, elt, factor_elt) > limit:
        if conf["num_stages"] <= 2:
            return None
        conf["num_stages"] -= 1
    return conf


def fit_smaller(phase: str, conf: dict, r_pad: int, elt: int, limit: int) -> dict | None:
    """``fit`` with BLOCK_M halved (not below 16) until two stages fit: the last resort where the
    default itself overflows, as bwd_dy's 256-row tile does at R_PAD=256."""
    conf = dict(conf)
    while (fitted := fit(phase, conf, r_pad, elt, limit)) is None and conf.get("BLOCK_M", 16) > 16:
        conf["BLOCK_M"] //= 2
    return fitted


_FLAGS = ("USE_TMA", "DB_PARTIAL")  # 0/1 switches
_POW2 = ("BLOCK", "num_warps")  # BLOCK_* are tl.arange extents; warps come in powers of two


def config_problem(conf: dict) -> str | None:
    """Why a cached config cannot be launched (``BLOCK_M: 0``, ``num_warps: "eight"``), or None."""
    for key, value in conf.items():
        if type(value) is not int:  # bool and float are not configs either
            return f"{key}={value!r} is not an int"
        if key in _FLAGS:
            if value not in (0, 1):
                return f"{key}={value} is not 0 or 1"
        elif value < 1:
            return f"{key}={value} is not positive"
        elif key.startswith(_POW2) and value & (value - 1):
            return f"{key}={value} is not a power of two"
    return None


def gemm_configs(elt: int = 2) -> list[dict]:
    """Pruned gemm configs for Hopper (228 KB shared memory per SM).

    Measured not to help on the H100 (triton 3.6), within +-2% or slower at the Llama shapes:
    flattening the tile loop (``tl.range(..., flatten=True)``), warp specialization of the K loop
    or of the persistent tile loop, one program per tile instead of the persistent loop, the h
    and u loads ahead of the K loop, a split TMA store for a 4th stage, and h = x @ a.T made
    inside the forward gemm instead of by fwd_h (0.98-1.11x the two launches, and its cross-tile
    spin-wait deadlocks when not every program is resident: MPS or green-context SM limits).
    """

    def keep(conf: dict) -> bool:
        bm, bn = conf["BLOCK_M"], conf["BLOCK_N"]
        if smem_bytes("gemm", conf, 16, elt) > 220 * 1024:
            return False
        # a 128x256 fp32 accumulator is 256 registers/thread at 4 warps: spills
        if bm * bn >= 128 * 256 and conf["num_warps"] < 8:
            return False
        return not (bm * bn <= 128 * 128 and conf["num_warps"] > 4 and bm < 256)

    out = []
    for bm, bn, bk in ((128, 256, 64), (128, 128, 64), (128, 128, 128), (256, 128, 64), (128, 256, 128)):
        for stages in (3, 4, 5):
            for warps in (4, 8):
                conf = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk if elt == 2 else bk // 2,
                            GROUP_M=8, num_warps=warps, num_stages=stages)
                if keep(conf) and conf not in out:
                    out.append(conf)
    return out


def fwd_h_configs() -> list[dict]:
    """Skinny x @ a.T: bandwidth-bound, small BLOCK_M so M=2048 still fills 132 SMs.

    USE_TMA=1 loads x (and a) through device-side TMA descriptors (needs 16-byte strides; the
    launcher falls back to pointer loads otherwise).
    """
    out = []
    for tma in (0, 1):
        for bm, bk in ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128)):
            for stages in (3, 4):
                for warps in ((4, 8) if bm * bk >= 128 * 128 else (4,)):
                    out.append(dict(BLOCK_M=bm, BLOCK_K=bk, USE_TMA=tma, num_warps=warps, num_stages=stages))
    return out


def bwd_dy_configs() -> list[dict]:
    """One pass over dy; SPLIT_N trades db partials (M/BLOCK_M * N * R) for dh atomics (SPLIT_N * M * R).

    DB_PARTIAL=1 stores each m-block's db partial (plain stores) and sums them in a second small
    kernel; DB_PARTIAL=0 adds them into one fp32 buffer with atomics.
    """
    out = []
    for tma in (0, 1):
        for partial in (0, 1):
            for bm, bn in ((128, 64), (256, 64), (128, 128)):
                for split in ((1, 2, 4) if bm == 128 else (2, 4, 8)):
                    for warps in ((4, 8) if bm * bn >= 256 * 64 else (4,)):
                        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_N=split, USE_TMA=tma, DB_PARTIAL=partial,
                                        num_warps=warps, num_stages=3))
    return out


def bwd_da_configs() -> list[dict]:
    """dh.T @ d: split M over SPLIT_M programs per K block, reduced with fp32 atomics."""
    out = []
    for tma in (0, 1):
        for bm, bk in ((64, 64), (64, 128), (128, 128), (64, 256)):
            for split in (4, 8, 16):
                for warps in ((4, 8) if bm * bk >= 128 * 128 else (4,)):
                    out.append(dict(BLOCK_M=bm, BLOCK_K=bk, SPLIT_M=split, USE_TMA=tma, num_warps=warps,
                                    num_stages=3))
    return out


CONFIGS = {"gemm": gemm_configs, "fwd_h": fwd_h_configs, "bwd_dy": bwd_dy_configs, "bwd_da": bwd_da_configs}

# Untuned defaults on CUDA. gemm: 128x256x64, 3 stages, 8 warps is the best Hopper bf16 config of
# Triton's persistent-matmul tutorial and of fastaf-tune's Llama-3-8B shapes (1.00-1.05x cuBLAS on H200).
DEFAULTS = {
    "gemm": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "gemm_plain": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
    # skinny kernels: the most frequent fastaf-tune winners on H200 (triton 3.6), e.g. fwd_h 28.8 us,
    # bwd_dy 45.6 us, bwd_da 32.0 us at M=8192 K=N=4096 r=64; TMA loads and db partials won only
    # at a few shapes (bwd_dy M<=8192 N=4096 r=16: 48.8 vs 53.4 us)
    "fwd_h": dict(BLOCK_M=64, BLOCK_K=128, USE_TMA=0, num_warps=4, num_stages=4),
    "bwd_dy": dict(BLOCK_M=256, BLOCK_N=64, SPLIT_N=4, USE_TMA=0, DB_PARTIAL=0, num_warps=4, num_stages=3),
    "bwd_da": dict(BLOCK_M=64, BLOCK_K=128, SPLIT_M=8, USE_TMA=0, num_warps=4, num_stages=3),
    "bwd_db": dict(BLOCK=1024, num_warps=4, num_stages=1),
}
# fp32 tiles take twice the shared memory: 128x256x64 x 3 stages needed 393 KB (limit 227 KB).
DEFAULTS_FP32 = {
    "gemm": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
    "gemm_plain": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
}
# TRITON_INTERPRET=1 (CPU tests): small blocks so odd shapes exercise every tail and the
# persistent loop runs more than one tile per program.
INTERPRET = {
    "gemm": dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
    "fwd_h": dict(BLOCK_M=16, BLOCK_K=32, USE_TMA=0, num_warps=4, num_stages=1),
    "bwd_dy": dict(BLOCK_M=16, BLOCK_N=16, SPLIT_N=2, USE_TMA=0, DB_PARTIAL=1, num_warps=4, num_stages=1),
    "bwd_da": dict(BLOCK_M=16, BLOCK_K=32, SPLIT_M=2, USE_TMA=0, num_warps=4, num_stages=1),
    "bwd_db": dict(BLOCK=64, num_warps=4, num_stages=1),
}
_INTERPRET_PROGRAMS = 2  # persistent grid size under the interpreter
