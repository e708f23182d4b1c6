"""Charts of bench/results/e2e.csv and linear.csv, one per bench and GPU, beside them as PNGs.

    python bench/plot.py          # needs matplotlib (pip install -e ".[bench]")

``e2e-<gpu>.png``: each provider's training step time over the frozen model's forward+backward
(the Llama-3.2-1B shape, 8 x 1024 tokens, one adapter), horizontal bars. ``linear-<gpu>.png``:
each LoRA linear provider's time over the cuBLAS base per shape, forward and forward+backward.
Each bar is the newest row of its provider and case on that GPU whose run also timed the base of
that case: a ratio is only ever taken within one process. Rows are newest last (runs append).
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import RESULTS, read, slug  # noqa: E402

E2E_LABELS = {  # provider -> what it runs (e2e.py's docstring)
    "base": "frozen model fwd+bwd (base)",
    "base-func": "frozen model under torch.func.grad",
    "base-compiled": "frozen model fwd+bwd, torch.compile",
    "peft": "PEFT, fp32 adapters",
    "peft-bf16": "PEFT, bf16 adapters",
    "peft-bf16-compiled": "PEFT, bf16 adapters, torch.compile",
    "fastaf-init": "fastaf init + loss.backward()",
    "fastaf-autograd": "fastaf functional_call + autograd",
    "fastaf-func": "fastaf functional_call + torch.func.grad",
    "fastaf-autograd-compiled": "fastaf compiled functional_call + autograd",
    "fastaf-func-compiled": "fastaf compiled torch.func.grad (fullgraph)",
}
E2E_CASE = {"model": "llama-3.2-1b-shape", "batch": "8", "seq": "1024"}
LINEAR_PROVIDERS = {"addmm": "addmm (unsloth's path)", "peft": "PEFT", "fastaf": "fastaf"}
COLORS = {"base": "0.6", "peft": "tab:orange", "addmm": "tab:blue", "fastaf": "tab:green"}
LINEAR_CAP = 1.6  # taller bars are cut here and labelled: the host-bound M=2048 cells reach 4x


def color(provider: str) -> str:
    return COLORS.get(provider.split("-")[0], "0.6")


def newest(rows: list[dict], case: tuple[str, ...], providers) -> dict[tuple, tuple[dict, dict]]:
    """{(provider, *case values): (row, its run's base row of that case)}: per provider and case,
    the newest row whose run has a timed ``base`` row of the same case."""
    bases = {(r["run"], *(r[k] for k in case)): r for r in rows if r["provider"] == "base" and r["ms"]}
    out: dict[tuple, tuple[dict, dict]] = {}
    for r in reversed(rows):  # newest first
        key = (r["provider"], *(r[k] for k in case))
        base = bases.get((r["run"], *(r[k] for k in case)))
        if r["provider"] in providers and r["ms"] and base is not None and key not in out:
            out[key] = (r, base)
    return out


def versions(pairs) -> str:
    """The GPU, torch / triton versions and fastaf builds the plotted rows come from."""
    rows = [r for pair in pairs for r in pair]
    pick = lambda col: ", ".join(sorted({r[col] or "?" for r in rows}))  # noqa: E731
    return f"{rows[0]['gpu']}, torch {pick('torch')}, triton {pick('triton')}\nfastaf {pick('sha')}"


def plot_e2e(gpu: str, rows: list[dict]) -> Path | None:
    """Horizontal bars: each provider's step time over its run's base, slowest at the bottom."""
    rows = [r for r in rows if all(r[k] == v for k, v in E2E_CASE.items()) and r["adapters"] in ("0", "1")]
    found = newest(rows, ("model", "batch", "seq", "r"), E2E_LABELS)
    if not found:
        return None
    bars = sorted(((float(r["ms"]) / float(b["ms"]), float(r["ms"]), r) for r, b in found.values()),
                  key=lambda t: t[0], reverse=True)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.6))
    y = range(len(bars))
    ax.barh(y, [q for q, _, _ in bars], color=[color(r["provider"]) for _, _, r in bars])
    for i, (q, ms, _) in enumerate(bars):
        ax.text(q + 0.02, i, f"{q:.2f}x  ({ms:.0f} ms)", va="center", fontsize=9)
    ax.set_yticks(list(y), [E2E_LABELS[r["provider"]] for _, _, r in bars])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, max(q for q, _, _ in bars) * 1.3)
    ax.set_xlabel("step time ÷ frozen model forward+backward in the same run (lower is better)")
    r0 = bars[0][2]
    ax.set_title(f"One LoRA training step: Llama-3.2-1B shape, {r0['batch']}x{r0['seq']} tokens, r={r0['r']}, "
                 f"bf16\n{versions(found.values())}", fontsize=10)
    return save(fig, RESULTS / f"e2e-{slug(gpu)}.png")


def plot_linear(gpu: str, rows: list[dict]) -> Path | None:
    """Grouped bars per shape: each provider's time over the cuBLAS base, forward above, fwd+bwd below."""
    case = ("mode", "M", "K", "N", "r")
    found = newest(rows, case, LINEAR_PROVIDERS)
    if not found:
        return None
    shapes = sorted({tuple(int(v) for v in key[2:]) for key in found})
    ratio = {key: float(r["ms"]) / float(b["ms"]) for key, (r, b) in found.items()}
    fig, axes = plt.subplots(2, 1, figsize=(15, 8), sharex=True)
    width = 0.8 / len(LINEAR_PROVIDERS)
    for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
        for j, (provider, label) in enumerate(LINEAR_PROVIDERS.items()):
            xs, qs = [], []
            for i, shape in enumerate(shapes):
                key = (provider, mode, *map(str, shape))
                if key in ratio:
                    xs.append(i + (j - (len(LINEAR_PROVIDERS) - 1) / 2) * width)
                    qs.append(ratio[key])
            # bars rise from 1.0: the height is the overhead over the base, where providers differ
            ax.bar(xs, [min(q, LINEAR_CAP) - 1 for q in qs], width, bottom=1, color=color(provider), label=label)
            for x, q in zip(xs, qs):
                if q > LINEAR_CAP:
                    ax.text(x, LINEAR_CAP, f"{q:.1f}", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_ylim(1.0, LINEAR_CAP + 0.12)
        ax.set_ylabel(f"{'forward' if mode == 'fwd' else 'forward+backward'}\ntime ÷ cuBLAS base")
        ax.grid(axis="y", linewidth=0.4)
        for i in range(1, len(shapes)):
            if shapes[i][0] != shapes[i - 1][0]:  # a line between token counts M
                ax.axvline(i - 0.5, color="black", linewidth=0.6)
    for m in sorted({shape[0] for shape in shapes}):
        group = [i for i, shape in enumerate(shapes) if shape[0] == m]
        axes[0].text(sum(group) / len(group), LINEAR_CAP + 0.1, f"M = {m} tokens", ha="center", va="top")
    axes[0].legend(loc="upper right", ncol=len(LINEAR_PROVIDERS), bbox_to_anchor=(1, 0.88))
    axes[1].set_xticks(range(len(shapes)), [f"K={k}\nN={n}\nr={r}" for _, k, n, r in shapes], fontsize=8)
    axes[0].set_title(f"One LoRA linear (K×N frozen weight, bf16), lower is better\n{versions(found.values())}",
                      fontsize=10)
    return save(fig, RESULTS / f"linear-{slug(gpu)}.png")


def save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    for bench, plot in (("e2e", plot_e2e), ("linear", plot_linear)):
        rows = read(bench)
        for gpu in sorted({r["gpu"] for r in rows} - {"cpu"}):
            path = plot(gpu, [r for r in rows if r["gpu"] == gpu])
            if path:
                print(path)


if __name__ == "__main__":
    main()
