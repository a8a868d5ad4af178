# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Watch ZeRO-3 gather and release
#
# Under ZeRO-3 a rank holds only a slice of each weight; outside a `forward` the weight's
# tensor is empty, shape `(0,)`. This notebook watches, moment by moment, when each weight of
# the [LanguageModel example](../../zero3/external-parameters/) is gathered to its full shape
# and when it is released again, in forward and in backward, with and without
# `register_external_parameter`.
#
# After reading it you will be able to record this timeline for your own model with three
# kinds of module hook, and to read from it which module's `forward` gathers a shared weight.
#
# Everything below was produced by running this notebook when the site was built; a failing
# cell fails the build. To run it yourself in JupyterLab, from a checkout of this
# repository:
#
# ```bash
# python3 tasks.py notebook
# ```
#
# It installs JupyterLab and jupytext into the project's environment (`.venv/`) and opens
# this file, `docs/notebooks/gather-and-release.py`, as a notebook; run it with
# *Run > Run All Cells*.

# %% [markdown]
# ## Run the example on two ranks
#
# ZeRO-3 needs several processes, and a notebook kernel is one. So the notebook starts a real
# two-rank run of `snippets/notebooks/gather_timeline.py` with `torchrun`, on CPU. That script
# trains the page's `LanguageModel` (loaded from `snippets/zero3/language_model.py`, not
# copied) for two steps, twice: as the page shows it, and with the registration undone. A
# module hook records what each rank holds of every parameter at each moment. The script
# and what it prints are on [the next page](../gather-timeline-script/).

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

root = Path.cwd()
script = Path("snippets", "notebooks", "gather_timeline.py")
while not (root / script).is_file():
    if root == root.parent:
        raise FileNotFoundError("run this notebook inside a checkout "
                                "of the repository")
    root = root.parent

events_file = Path(tempfile.mkdtemp()) / "events.json"
print("DS_ACCELERATOR=cpu torchrun --nproc_per_node 2", script,
      events_file.name)
run = subprocess.run(
    [sys.executable, "-m", "torch.distributed.run",
     "--nproc_per_node", "2", str(script), str(events_file)],
    cwd=root, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    capture_output=True, text=True, timeout=900)
if run.returncode != 0:
    raise RuntimeError(f"the run failed with exit code "
                       f"{run.returncode}:\n{run.stderr[-3000:]}")
recorded = json.loads(events_file.read_text())
timeline = recorded["variants"]
for variant, run_of in timeline.items():
    print(f"{variant:>15}: {len(run_of['events'])} moments recorded, "
          f"losses {run_of['losses']}")

# %% [markdown]
# Both variants train to the same losses: the registration changes *when* the weight is
# gathered, not the result.

# %% [markdown]
# ## The timeline
#
# Time runs down the page: one row per moment a hook fired, in order, for two training
# steps, first with the registration (two panels), then without it. One column per
# parameter. A colored cell means the rank held the full weight at
# that moment; a grey cell means it held only its empty partition, shape `(0,)`.
# `embeddings.weight` is orange.

# %%
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib_inline.backend_inline import set_matplotlib_formats

# SVG with its text kept as text: sharp at any width, and on the site the
# browser can measure it (the site's tests check it is at least 12 px high).
# bbox_inches=None: the figure keeps the width below (constrained_layout fits
# the labels inside it), whatever the labels' lengths; "tight" would widen it
# to the longest label, and a phone would show it, and its text, smaller.
set_matplotlib_formats("svg", bbox_inches=None)
PARAMS = ["embeddings.weight", "mixer.weight", "mixer.bias"]
FONT_POINTS = 12
SMALLEST_POINTS = 12  # the column headers: the smallest text
# One column of four panels, narrow enough that a phone shows it at nearly
# its full size, so that its text stays readable there.
WIDTH_INCHES = 3.6


def moment_label(event):
    if event["phase"] == "forward":
        return f"{event['module']}.forward {event['moment']}"
    if event["module"] == "engine":
        return "engine.backward done"
    return f"backward reaches {event['module']}"


def full(event, name):
    return event["params"][name]["shape"] != [0]


plt.rcParams.update({"font.size": FONT_POINTS, "svg.fonttype": "none",
                     "svg.hashsalt": "gather-and-release",
                     "xtick.labelsize": SMALLEST_POINTS})
fig, axes = plt.subplots(4, 1, figsize=(WIDTH_INCHES, 16),
                         constrained_layout=True)
# 0: not held; 1: mixer's weight held; 2: embeddings.weight held
colors = ListedColormap(["#eceff1", "#3949ab", "#ef6c00"])
# Column edges: embeddings.weight, the longest name, gets the widest.
edges = [0, 1.5, 2.5, 3.5]
panels = [(variant, step) for variant in timeline for step in (0, 1)]
for ax, (variant, step) in zip(axes, panels):
    events = [e for e in timeline[variant]["events"] if e["step"] == step]
    grid = [[(2 if name == PARAMS[0] else 1) * full(e, name)
             for name in PARAMS] for e in events]
    ax.pcolormesh(edges, range(len(events) + 1), grid, cmap=colors,
                  vmin=0, vmax=2, edgecolors="white", linewidth=2)
    ax.set_ylim(len(events), 0)  # time runs down
    ax.set_title(f"{variant}, step {step}")
    ax.set_yticks([y + 0.5 for y in range(len(events))],
                  [moment_label(e) for e in events])
    ax.set_xticks([(a + b) / 2 for a, b in zip(edges, edges[1:])],
                  [n.replace(".", "\n.") for n in PARAMS], rotation=90)
    ax.tick_params(top=True, labeltop=True, bottom=False,
                   labelbottom=False, length=0)
fig.suptitle("colored: the rank holds the full weight\n"
             "grey: only its empty partition,\nshape (0,)")
plt.show()

# %% [markdown]
# ## What the timeline shows
#
# **Registered (first two panels), step 0.** `embeddings.weight` is full from the start of
# `LanguageModel.forward` to its end: the registration asks DeepSpeed to gather it for
# `LanguageModel.forward`, the forward that reads it in
# `compute_logits(hidden, self.embeddings.weight)`. `mixer`'s weights are full only during
# `mixer.forward`. At the end of `LanguageModel.forward` everything is released again.
#
# **Not registered (last two panels), step 0.** `embeddings.weight` is full only while
# `embeddings.forward` runs, like any module's own weight, and is already released when
# `mixer.forward` starts. The read in `LanguageModel.forward` still works: DeepSpeed gathers
# the weight when it is read and registers it on `LanguageModel` itself (this is the
# automatic detection described on
# [What DeepSpeed detects automatically](../../zero3/automatic-detection/)). After step 0
# the registration is there, so step 1 looks exactly like the registered run.
#
# **Step 1, both runs.** Step 1 differs from step 0: `mixer`'s weights are not released at
# the end of `mixer.forward` but stay full into backward. Step 0 is DeepSpeed's first pass
# through the model, and later steps can gather and release differently, as here: do not
# read release points off the first step alone. In both steps, nothing is held in full once
# `engine.backward` returns.
#
# **Why step 1 keeps them** (a reading of DeepSpeed's source,
# `deepspeed/runtime/zero/partitioned_param_coordinator.py`; the cell below checks only what
# the timeline shows): during step 0 DeepSpeed records the order in which modules run. From
# then on, at the end of a module's forward it does not release a weight that a module due
# to run soon uses again. "Soon" is the ZeRO-3 setting `stage3_max_reuse_distance`, counted in
# parameter elements: DeepSpeed walks the recorded order ahead of the current module, adding
# up the sizes (`numel`) of the parameters it passes, and keeps every weight it meets before
# the sum reaches that setting. The script leaves it at DeepSpeed's default, which the cell
# below prints next to the size of the whole model: the whole backward pass is "soon" here.
# A smaller value releases earlier and gathers again later: less memory, more communication.
#
# The cell below checks each of these sentences against the recorded timeline; if a
# DeepSpeed version behaves differently, this cell fails and the site does not build.

# %%
def held(variant, step, module, phase, moment):
    """The parameters held in full at one recorded moment."""
    [event] = [e for e in timeline[variant]["events"]
               if (e["step"], e["module"], e["phase"], e["moment"])
               == (step, module, phase, moment)]
    return {name for name in PARAMS if full(event, name)}


REG, NOT = "registered", "not registered"
EMB, MIXER = {"embeddings.weight"}, {"mixer.weight", "mixer.bias"}
# Registered, step 0: gathered for LanguageModel.forward, released
# at its end.
assert held(REG, 0, "LanguageModel", "forward", "start") == EMB
assert EMB <= held(REG, 0, "mixer", "forward", "start")
assert held(REG, 0, "LanguageModel", "forward", "end") == set()
assert held(REG, 0, "mixer", "forward", "end") == EMB
# Not registered, step 0: only during embeddings.forward.
assert held(NOT, 0, "LanguageModel", "forward", "start") == set()
assert held(NOT, 0, "embeddings", "forward", "start") == EMB
assert held(NOT, 0, "embeddings", "forward", "end") == set()
assert held(NOT, 0, "mixer", "forward", "start") == MIXER
# ... and DeepSpeed registered it on LanguageModel during step 0.
assert timeline[NOT]["external"][0] == ["embeddings.weight"]
# Step 1 is the same moment by moment in both runs.
for a, b in zip(timeline[REG]["events"], timeline[NOT]["events"]):
    if a["step"] == 1:
        assert a == b
# Step 1 keeps mixer's weights from its forward into backward.
assert MIXER <= held(REG, 1, "mixer", "forward", "end")
# Nothing is held in full after engine.backward; both runs train alike.
for variant in timeline:
    for step in (0, 1):
        assert held(variant, step, "engine", "backward", "end") == set()
assert timeline[REG]["losses"] == timeline[NOT]["losses"]
# The reuse distance covers the whole model, so the backward pass too.
assert recorded["max_reuse_distance"] > recorded["model_numel"]
print("stage3_max_reuse_distance:", recorded["max_reuse_distance"],
      "parameter elements (DeepSpeed's default)")
print("parameter elements in the whole model:", recorded["model_numel"])
print("all checks passed")

# %% [markdown]
# ## Record it for your own model
#
# The recorder is three hooks on every module, added after `deepspeed.initialize` so that in
# forward they run after DeepSpeed's own: a forward pre-hook ("start": DeepSpeed has gathered
# what the module needs), a forward hook ("end": it has released what it frees), and a full
# backward pre-hook (backward reaches the module). The script also records one moment by
# hand, after `engine.backward` returns.
#
# ```python
# for name, module in engine.module.named_modules():
#     module.register_forward_pre_hook(
#         lambda m, a, name=name: record(name, "forward", "start"))
#     module.register_forward_hook(
#         lambda m, a, o, name=name: record(name, "forward", "end"))
#     module.register_full_backward_pre_hook(
#         lambda m, g, name=name: record(name, "backward", "start"))
# ```
#
# where `record` saves `p.data.shape` (full, or `(0,)`) and `p.ds_status` for every parameter.
# A weight that is full only inside its owner's `forward` while another `forward` reads it is
# the one to look at: on the first step, DeepSpeed gathers it for the reader on the fly; with
# `register_external_parameter` it is gathered with the reader's other parameters from the
# start.
