"""MkDocs hook: draw the bytes-held timeline of docs/zero3/sharing-cost.md at build time.

The data is snippets/zero3/sharing_cost.tsv, written from a real 2-rank run by
`pytest tests/zero3/test_sharing_cost.py --update-outputs` and compared with every run of
that test. The build draws it into zero3/sharing-cost.svg without running DeepSpeed.

Drawing takes about 3 s (importing matplotlib and rendering), most of a no-change build, so the
image is kept in .cache/sharing-cost/ under a checksum of the data, this file and the
matplotlib release: it is drawn again only when one of them changes.
"""

import csv
import hashlib
import io
from pathlib import Path

from mkdocs.structure.files import File

DATA = "snippets/zero3/sharing_cost.tsv"
IMAGE = "zero3/sharing-cost.svg"
# The same plot for phones: one column, larger text, so that its smallest text is at least
# 12 CSS px high when a 390 px wide screen shows it (the page picks it with <picture>).
IMAGE_NARROW = "zero3/sharing-cost-narrow.svg"
LAYOUTS = {  # image: (rows, columns, figure size in inches, font size in points)
    IMAGE: (3, 2, (9, 8.5), 11),
    IMAGE_NARROW: (6, 1, (4.2, 15), 13),
}
MIB = 2**20
PANELS = [  # variant in the data, title of its panel
    ("registered", "registered (or detected), default settings"),
    ("own module", "own module, default settings"),
    ("registered, reuse 0, prefetch 0", "registered, reuse 0, prefetch 0"),
    ("own module, reuse 0, prefetch 0", "own module, reuse 0, prefetch 0"),
    ("detected", "detected, default settings"),
    ("registered F.linear, reuse 0, prefetch 0", "registered F.linear, reuse 0, prefetch 0"),
]


def read(path):
    timeline = {}
    with open(path, newline="") as data:
        for row in csv.DictReader(data, delimiter="\t"):
            timeline.setdefault(row["variant"], []).append(row)
    return timeline


def draw(timeline, image_format="svg", layout=IMAGE):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, columns, size, points = LAYOUTS[layout]
    plt.rcParams.update({"font.size": points, "svg.hashsalt": "sharing-cost", "svg.fonttype": "none"})
    fig, axes = plt.subplots(rows, columns, figsize=size, sharey=True, constrained_layout=True,
                             squeeze=False)
    for ax, (variant, title) in zip(axes.flat, PANELS):
        rows = timeline[variant]
        x = range(len(rows))
        held = [int(r["held_bytes"]) / MIB for r in rows]
        allocated = [int(r["allocated_bytes"]) / MIB for r in rows]
        ax.fill_between(x, held, step="mid", color="#3949ab", alpha=0.85, label="held (gathered)")
        ax.step(x, allocated, where="mid", color="#d81b60", linewidth=1.6, linestyle="--",
                label="still allocated")
        boundary = next(i for i, r in enumerate(rows) if r["step"] == "1") - 0.5
        ax.axvline(boundary, color="black", linewidth=1.2)
        for i, r in enumerate(rows):
            if r["moment"] == "model.backward start":
                ax.axvspan(i - 0.5, next(j for j in range(i, len(rows)) if rows[j]["moment"] == "engine.backward returned") + 0.5,
                           color="#eeeeee", zorder=0)
        ax.set_title(title, loc="left", fontsize=points)
        ax.set_xlim(-0.5, len(rows) - 0.5)
        ax.set_xticks([boundary / 2, (boundary + len(rows)) / 2], ["step 0", "step 1"])
        ax.tick_params(axis="x", length=0)
        ax.set_yticks(range(0, 9, 2))
        ax.grid(axis="y", color="#dddddd", linewidth=0.8)
    for ax in axes[:, 0]:
        ax.set_ylabel("MiB per rank")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    import matplotlib.patches as patches

    handles.append(patches.Patch(color="#eeeeee", label="backward"))
    fig.legend(handles=handles, loc="outside lower center", ncol=3 if columns > 1 else 2, frameon=False)
    image = io.StringIO() if image_format == "svg" else io.BytesIO()
    fig.savefig(image, format=image_format, metadata={"Date": None} if image_format == "svg" else None, dpi=80)
    plt.close(fig)
    return image.getvalue()


def cached_image(root, layout=IMAGE):
    """The SVG for the data under `root`, from .cache/sharing-cost/ when it is there."""
    from importlib.metadata import version

    key = hashlib.sha256()
    for part in ((root / DATA).read_bytes(), Path(__file__).read_bytes(), version("matplotlib").encode()):
        key.update(hashlib.sha256(part).digest())
    name = Path(layout).stem
    cached = root / ".cache" / "sharing-cost" / f"{name}-{key.hexdigest()}.svg"
    if cached.exists():
        return cached.read_text()
    image = draw(read(root / DATA)) if layout == IMAGE else draw(read(root / DATA), layout=layout)
    cached.parent.mkdir(parents=True, exist_ok=True)
    for stale in cached.parent.glob(f"{name}-*.svg"):
        stale.unlink()
    partial = cached.with_suffix(".partial")
    partial.write_text(image)
    partial.replace(cached)
    return image


def on_files(files, config):
    root = Path(config.config_file_path).parent
    files.append(File.generated(config, IMAGE, content=cached_image(root)))
    files.append(File.generated(config, IMAGE_NARROW, content=cached_image(root, IMAGE_NARROW)))
    return files
