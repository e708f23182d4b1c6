"""Charts of the committed end-to-end and linear results, next to their JSON.

    python bench/plot.py          # needs matplotlib (pip install -e ".[bench]")

Renders the results that bench_e2e.py and bench_linear.py write, ``bench/results/<bench>-<gpu>.json``,
to PNGs beside them: ``e2e-<gpu>.png`` (each provider's training step time ÷ the frozen model's
forward+backward, horizontal bars) and ``linear-<gpu>.png`` (each LoRA linear provider's time ÷ the
cuBLAS base per shape, forward and forward+backward). A/B runs and diagnostics, whose names carry a
tag before the GPU (``e2e-liger-<gpu>.json``), are not charted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import RESULTS, slug  # noqa: E402

E2E_LABELS = {  # provider -> what it runs (bench_e2e.py's docstring)
    "base": "frozen model fwd+bwd (base)",
    "base-func": "frozen model under torch.func.grad",
    "base-compiled": "frozen model fwd+bwd, torch.compile",
    "peft": "PEFT, fp32 adapters",
    "peft-bf16": "PEFT, bf16 adapters",
    "fastaf-init": "fastaf init + loss.backward()",
    "fastaf-autograd": "fastaf functional_call + autograd",
    "fastaf-func": "fastaf functional_call + torch.func.grad",
    "fastaf-func-compiled": "fastaf compiled torch.func.grad (fullgraph)",
}
LINEAR_PROVIDERS = {"addmm": "addmm (unsloth's path)", "peft": "PEFT", "fastaf": "fastaf"}
COLORS = {"base": "0.6", "peft": "tab:orange", "addmm": "tab:blue", "fastaf": "tab:green"}
LINEAR_CAP = 1.6  # taller bars are cut here and labelled: the host-bound M=2048 cells reach 4.3x


def color(provider: str) -> str:
    return COLORS.get(provider.split("-")[0], "0.6")


def title(meta: dict) -> str:
    return f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']} (fastaf {meta['fastaf_sha']})"


def results(bench: str) -> list[tuple[Path, dict]]:
    """Each ``<bench>-<gpu slug>.json`` in bench/results with its contents, the name as the harness writes it."""
    found = [(path, json.loads(path.read_text())) for path in sorted(RESULTS.glob(f"{bench}-*.json"))]
    return [(path, data) for path, data in found if path.name == f"{bench}-{slug(data['meta']['gpu'])}.json"]


def plot_e2e(path: Path, data: dict) -> Path:
    """Horizontal bars: each provider's step time ÷ the base row's, slowest at the bottom. Rows
    marked ``invalid`` (a timing of a broken step) are left out and named under the chart."""
    invalid = [r["provider"] for r in data["rows"] if r.get("invalid")]
    rows = [r for r in data["rows"] if not r.get("invalid")]
    base = next(r["ms"] for r in rows if r["provider"] == "base")
    rows = sorted(rows, key=lambda r: r["ms"], reverse=True)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    y = range(len(rows))
    ax.barh(y, [r["ms"] / base for r in rows], color=[color(r["provider"]) for r in rows])
    for i, r in enumerate(rows):
        ax.text(r["ms"] / base + 0.02, i, f"{r['ms'] / base:.2f}x  ({r['ms']:.0f} ms)", va="center", fontsize=9)
    ax.set_yticks(list(y), [E2E_LABELS.get(r["provider"], r["provider"]) for r in rows])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, max(r["ms"] for r in rows) / base * 1.3)
    ax.set_xlabel("step time ÷ frozen model forward+backward (lower is better)"
                  + (f"\nleft out, timed invalid in this run: {', '.join(invalid)}" if invalid else ""))
    r0, meta = rows[0], data["meta"]
    ax.set_title(f"One LoRA training step: Llama-3.2-1B shape, {meta['batch']}x{meta['seq']} tokens, "
                 f"r={r0['r']}, {r0['dtype']}\n{title(meta)}", fontsize=10)
    return save(fig, path)


def plot_linear(path: Path, data: dict) -> Path:
    """Grouped bars per shape: each provider's time ÷ the cuBLAS base, forward above, fwd+bwd below."""
    rows = data["rows"]
    shapes = sorted({(r["M"], r["K"], r["N"], r["r"]) for r in rows})
    ms = {(r["M"], r["K"], r["N"], r["r"], r["mode"], r["provider"]): r["ms"] for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(15, 8), sharex=True)
    width = 0.8 / len(LINEAR_PROVIDERS)
    for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
        for j, (provider, label) in enumerate(LINEAR_PROVIDERS.items()):
            xs, ratios = [], []
            for i, shape in enumerate(shapes):
                if (*shape, mode, provider) in ms:
                    xs.append(i + (j - (len(LINEAR_PROVIDERS) - 1) / 2) * width)
                    ratios.append(ms[(*shape, mode, provider)] / ms[(*shape, mode, "base")])
            # bars rise from 1.0: the height is the overhead over the base, where providers differ
            ax.bar(xs, [min(q, LINEAR_CAP) - 1 for q in ratios], width, bottom=1, color=color(provider), label=label)
            for x, q in zip(xs, ratios):
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
    axes[0].set_title(f"One LoRA linear (K×N frozen weight, {rows[0]['dtype']}), lower is better\n"
                      f"{title(data['meta'])}", fontsize=10)
    return save(fig, path)


def save(fig: plt.Figure, path: Path) -> Path:
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    for path, data in results("e2e"):
        print(plot_e2e(path, data))
    for path, data in results("linear"):
        print(plot_linear(path, data))


if __name__ == "__main__":
    main()
