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
# After reading it you will be able to record this timeline for your own model with four
# module hooks, and to read from it which module's `forward` gathers a shared weight.
#
# Everything below was produced by running this notebook when the site was built; a failing
# cell fails the build. To run it yourself, open `docs/notebooks/gather-and-release.py` in
# Jupyter with [jupytext](https://jupytext.readthedocs.io/) from a checkout of this repository,
# inside the environment `python3 tasks.py` made.

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
while not (root / "snippets" / "notebooks" / "gather_timeline.py").is_file():
    if root == root.parent:
        raise FileNotFoundError("run this notebook from inside a checkout of the repository")
    root = root.parent

events_file = Path(tempfile.mkdtemp()) / "events.json"
command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "snippets/notebooks/gather_timeline.py", str(events_file)]
print("DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/notebooks/gather_timeline.py",
      events_file.name)
run = subprocess.run(command, cwd=root, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                     capture_output=True, text=True, timeout=900)
if run.returncode != 0:
    raise RuntimeError(f"the run failed with exit code {run.returncode}:\n{run.stderr[-3000:]}")
timeline = json.loads(events_file.read_text())
for variant, recorded in timeline.items():
    print(f"{variant:>15}: {len(recorded['events'])} moments recorded, losses {recorded['losses']}")

# %% [markdown]
# Both variants train to the same losses: the registration changes *when* the weight is
# gathered, not the result.

# %% [markdown]
# ## The timeline
#
# One row per parameter, labelled with the module that owns it; one column per moment a hook
# fired, in order, for two training steps. A dark cell means the rank held the full weight at
# that moment; a light cell means it held only its empty partition, shape `(0,)`.

# %%
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap

PARAMS = ["embeddings.weight", "mixer.weight", "mixer.bias"]


def moment_label(event):
    if event["phase"] == "forward":
        return f"{event['module']}.forward {event['moment']}"
    if event["module"] == "engine":
        return "engine.backward done"
    return f"backward reaches {event['module']}"


def full(event, name):
    return event["params"][name]["shape"] != [0]


plt.rcParams["font.size"] = 11
fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True, constrained_layout=True)
fig.suptitle("dark: the rank holds the full weight    light: only its empty partition, shape (0,)")
for ax, (variant, recorded) in zip(axes, timeline.items()):
    events = recorded["events"]
    grid = [[1 if full(e, name) else 0 for e in events] for name in PARAMS]
    ax.imshow(grid, aspect="auto", cmap=ListedColormap(["#e8eaf6", "#3949ab"]), vmin=0, vmax=1)
    ax.set_yticks(range(len(PARAMS)),
                  [f"{n.split('.')[0]}: {n.split('.')[1]}" for n in PARAMS])
    boundary = next(i for i, e in enumerate(events) if e["step"] == 1) - 0.5
    ax.axvline(boundary, color="black", linewidth=2)
    ax.set_title(f"embeddings.weight {variant} (step 0 | step 1)", loc="left")
    ax.set_xticks(range(len(events)), [moment_label(e) for e in events], rotation=90)
    ax.set_xticks([x + 0.5 for x in range(len(events))], minor=True)
    ax.set_yticks([y + 0.5 for y in range(len(PARAMS))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
plt.show()

# %% [markdown]
# ## What the timeline shows
#
# **Registered (top).** In step 0, `embeddings.weight` is full from the start of
# `LanguageModel.forward` to its end: the registration asks DeepSpeed to gather it for
# `LanguageModel.forward`, the forward that reads it in
# `compute_logits(hidden, self.embeddings.weight)`. `mixer`'s weights are full only during
# `mixer.forward`. At the end of `LanguageModel.forward` everything is released again.
#
# **Not registered (bottom), step 0.** `embeddings.weight` is full only while
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
# The cell below checks each of these sentences against the recorded timeline; if a
# DeepSpeed version behaves differently, this cell fails and the site does not build.

# %%
def held(variant, step, module, phase, moment):
    """The parameters held in full at one recorded moment."""
    [event] = [e for e in timeline[variant]["events"]
               if (e["step"], e["module"], e["phase"], e["moment"]) == (step, module, phase, moment)]
    return {name for name in PARAMS if full(event, name)}


# Registered, step 0: gathered for LanguageModel.forward, released at its end.
assert held("registered", 0, "LanguageModel", "forward", "start") == {"embeddings.weight"}
assert "embeddings.weight" in held("registered", 0, "mixer", "forward", "start")
assert held("registered", 0, "LanguageModel", "forward", "end") == set()
assert held("registered", 0, "mixer", "forward", "end") == {"embeddings.weight"}
# Not registered, step 0: only during embeddings.forward.
assert held("not registered", 0, "LanguageModel", "forward", "start") == set()
assert held("not registered", 0, "embeddings", "forward", "start") == {"embeddings.weight"}
assert held("not registered", 0, "embeddings", "forward", "end") == set()
assert held("not registered", 0, "mixer", "forward", "start") == {"mixer.weight", "mixer.bias"}
# ... and DeepSpeed registered it on LanguageModel during step 0.
assert timeline["not registered"]["external"][0] == ["embeddings.weight"]
# Step 1 is the same moment by moment in both runs.
for a, b in zip(timeline["registered"]["events"], timeline["not registered"]["events"]):
    if a["step"] == 1:
        assert (a["module"], a["phase"], a["moment"], a["params"]) == (b["module"], b["phase"], b["moment"], b["params"])
# Step 1 keeps mixer's weights from its forward into backward.
assert {"mixer.weight", "mixer.bias"} <= held("registered", 1, "mixer", "forward", "end")
# Nothing is held in full after engine.backward, and both runs train alike.
for variant in timeline:
    for step in (0, 1):
        assert held(variant, step, "engine", "backward", "end") == set()
assert timeline["registered"]["losses"] == timeline["not registered"]["losses"]
print("all checks passed")

# %% [markdown]
# ## Record it for your own model
#
# The recorder is four lines of hooks, added after `deepspeed.initialize` so that in forward
# they run after DeepSpeed's own: at "start" DeepSpeed has gathered what the module needs, at
# "end" it has released what it frees.
#
# ```python
# for name, module in engine.module.named_modules():
#     module.register_forward_pre_hook(lambda m, a, name=name: record(name, "forward", "start"))
#     module.register_forward_hook(lambda m, a, o, name=name: record(name, "forward", "end"))
#     module.register_full_backward_pre_hook(lambda m, g, name=name: record(name, "backward", "start"))
# ```
#
# where `record` saves `p.data.shape` (full, or `(0,)`) and `p.ds_status` for every parameter.
# A weight that is full only inside its owner's `forward` while another `forward` reads it is
# the one to look at: on the first step, DeepSpeed gathers it for the reader on the fly; with
# `register_external_parameter` it is gathered with the reader's other parameters from the
# start.
