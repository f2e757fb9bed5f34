"""The limits table of experiments/limits/README.md from the runs' metrics.json files.

Usage: python experiments/limits/table.py FOLDER
FOLDER holds {triton,flash}_<variant>.metrics.json (experiments/limits/run.sh's runs).
"""

import json
import sys
from pathlib import Path

COLUMNS = (
    ("fwd ms", "fwd_ms", "{:.3f}"),
    ("fwd+bwd ms", "fwd_bwd_ms", "{:.2f}"),
    ("fwd of peak", "fwd_peak_fraction", "{:.3f}"),
    ("fwd+bwd of peak", "fwd_bwd_peak_fraction", "{:.3f}"),
    ("kept density", "mask_density", "{:.4f}"),
    ("spent / kept", "flops_spent_over_kept", "{:.3f}"),
    ("fwd J", "fwd_joules", "{:.2f}"),
    ("fwd+bwd J", "fwd_bwd_joules", "{:.2f}"),
    ("fwd+bwd W", "fwd_bwd_watts", "{:.0f}"),
    ("fwd+bwd µJ/token", "fwd_bwd_joules_per_token", "{:.0f}"),
    ("cuDNN fwd of peak", "sdpa_cudnn_fwd_peak_fraction", "{:.3f}"),
    ("cuDNN fwd+bwd of peak", "sdpa_cudnn_fwd_bwd_peak_fraction", "{:.3f}"),
)


def cell(metrics: dict, key: str, form: str) -> str:
    value = metrics.get(key)
    if value is None:
        return "—"
    return form.format(value * 1e6 if key.endswith("_per_token") else value)


def main(folder: Path) -> None:
    print("| variant | backend | " + " | ".join(c[0] for c in COLUMNS) + " | kernel fwd / bwd |")
    print("|---|---|" + "--:|" * len(COLUMNS) + "---|")
    runs = [*folder.glob("triton_*.metrics.json"), *folder.glob("flash_*.metrics.json")]
    for path in sorted(runs, key=lambda p: p.name.split("_", 1)[::-1]):
        backend, variant = path.name.removesuffix(".metrics.json").split("_", 1)
        m = json.loads(path.read_text())
        kernels = " / ".join(
            str(m.get(f"kernel_path_{p}", "—")).split(" (")[0] for p in ("fwd", "bwd")
        )
        cells = " | ".join(cell(m, key, form) for _, key, form in COLUMNS)
        print(f"| {variant} | {backend} | {cells} | {kernels} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
