"""Where an adapted layer's forward host time goes, on the Liger-patched 1B shape (8 x 1024).

    python bench/diag_fwd_parts.py [--steps 12]

The eager forward of a LoRA step is host-bound, so its CPU time is its host cost. Each variant
stubs one part of ``fastaf-autograd``'s path (``bench/diag_host.py``) and the forward CPU time
(median, providers alternating step by step) shows what that part costs per adapted layer:
- ``carrier-only``: the carried weight's ``F.linear`` runs the base linear (no LoRA op at all);
- ``no-launch``: the full op path, but the Triton launches return at once (outputs allocated,
  never written: timings only);
- ``full``: the op as it is.
The differences divided by the 112 adapted layers are per-layer costs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_e2e import _liger, make_model  # noqa: E402
from bench.diag_host import _phases  # noqa: E402

from fastaf.functional import _mode  # noqa: E402
from fastaf.kernels import _launch  # noqa: E402


def _carrier_only(mode, route, x, weight, bias, **kw):
    mode._count(route)  # an adapted use, as far as the call's check is concerned
    return F.linear(x, weight, bias)


def _no_launch(self, grid, args, meta, meta_key):
    return None


def _no_relaunch(self, entry, grid, args):
    return True  # "launched": the kernel kept for a call signature is not run either


VARIANTS = {"full": [], "carrier-only": [(_mode.LoRAMode, "_apply", _carrier_only)],
            "no-launch": [(_launch.LaunchSite, "__call__", _no_launch), (_launch.LaunchSite, "again", _no_relaunch)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    model = _liger(make_model(False, "cuda"))
    ids = torch.randint(0, model.config.vocab_size, (8, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    base, _ = _phases(model, ids, "base")
    fast, _ = _phases(model, ids, "fastaf-autograd")
    originals = {(owner, name): getattr(owner, name) for v in VARIANTS.values() for owner, name, _ in v}
    times: dict[str, list[float]] = {"base": [], **{v: [] for v in VARIANTS}}
    for i in range(args.steps + 2):
        for name in times:
            patches = VARIANTS.get(name, [])
            for owner, attr, fn in patches:
                setattr(owner, attr, fn)
            try:
                torch.cuda.synchronize()
                c0 = time.process_time()
                loss = (base if name == "base" else fast)()
                c1 = time.process_time()
                loss.backward() if name in ("base", "full") else None
                del loss
                torch.cuda.synchronize()
            finally:
                for owner, attr, _ in patches:
                    setattr(owner, attr, originals[(owner, attr)])
            if i >= 2:
                times[name].append((c1 - c0) * 1e3)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print("forward CPU ms (median):", {k: round(v, 2) for k, v in med.items()})
    layers = 112
    print(f"per adapted layer, us: carrier dispatch + base linear over base: "
          f"{(med['carrier-only'] - med['base']) * 1e3 / layers:.1f}; op path without launches: "
          f"{(med['no-launch'] - med['carrier-only']) * 1e3 / layers:.1f}; launches: "
          f"{(med['full'] - med['no-launch']) * 1e3 / layers:.1f}")


if __name__ == "__main__":
    main()
