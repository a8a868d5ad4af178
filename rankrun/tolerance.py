"""The one tolerance policy for comparing a distributed run with its one-process reference.

Why not a fixed absolute number: float32 has a 24-bit significand, so neighbouring values near
9.6 are 2**-20 ≈ 9.5e-7 apart. A distributed run adds the same terms in another order than one
process (a reduce-scatter over ranks, another blocking of a matrix product, other SIMD kernels
on another CPU), and every reordered sum may land on a neighbouring value; a few steps of
training carry such differences on. `abs=1e-6` asks a loss near 9.6 to agree to one unit in
the last place, which holds on one CPU and fails on the next.

The policy: two values agree when they differ by at most `ULPS` units of the dtype's machine
epsilon (float32: 2**-23 ≈ 1.19e-7) scaled by the magnitude of what is compared, the largest
absolute value of the reference:

    max |got - want|  <=  ULPS[dtype] * eps(dtype) * max |want|

taken over one compared quantity (a tensor, or a list of step losses). Scaling by the largest
value, not each element's own, is what a reordered sum allows: its error is relative to the
terms summed, so a gradient entry near zero may carry the error of the large entries beside it.
A reference that is exactly zero is matched exactly (an unused parameter's gradient is zero in
any order of summation). Where the compared value is itself a sum that cancels (the sum of a
weight's entries, say), pass `scale=` the magnitude of its terms (the sum of their absolute
values): that is what the rounding of the sum is relative to.

64 float32 units (a relative error of 7.6e-6) leave a wide margin above what reordering does in
these examples (the deviations measured on every PyTorch CPU kernel set are on the testing page)
and stay far below any real bug, which shows as a difference in the third or fourth digit.
bfloat16 has an 8-bit significand (eps 2**-7 ≈ 7.8e-3); a bf16 run against a float32 reference
rounds every product, so it gets its own count.

Set RANKRUN_DEVIATIONS to a file path to record every comparison's deviation (in units of
eps * max|want|) as one JSON line, with the test that made it: `benchmarks/deviations.py`
summarizes them per example and kernel set.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence

import torch

ULPS = {torch.float32: 64, torch.bfloat16: 16}


def eps(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps


def allowed_difference(want, dtype: torch.dtype = torch.float32, ulps: float | None = None,
                       scale: float | None = None) -> float:
    """The largest |got - want| the policy accepts for the quantity `want`."""
    count = ULPS[dtype] if ulps is None else ulps
    return count * eps(dtype) * (_magnitude(want) if scale is None else scale)


def _as_tensor(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.as_tensor(value, dtype=torch.float64)


def _magnitude(want) -> float:
    tensor = _as_tensor(want)
    return tensor.abs().max().item() if tensor.numel() else 0.0


def _leaves(got, want, label: str):
    """Pairs (label, got, want) of the compared quantities: a tensor, a number, or a flat list of
    numbers is one quantity; dicts and lists of tensors are walked."""
    if isinstance(want, Mapping):
        if not isinstance(got, Mapping) or got.keys() != want.keys():
            got_keys = sorted(got) if isinstance(got, Mapping) else type(got).__name__
            raise AssertionError(f"{label}: keys {got_keys} != {sorted(want)}")
        for key in want:
            yield from _leaves(got[key], want[key], f"{label}[{key!r}]" if label else repr(key))
    elif isinstance(want, Sequence) and not isinstance(want, str) and want and not isinstance(want[0], (int, float)):
        if not isinstance(got, Sequence) or len(got) != len(want):
            raise AssertionError(f"{label}: {len(got) if isinstance(got, Sequence) else got!r} items, expected {len(want)}")
        for index, (g, w) in enumerate(zip(got, want)):
            yield from _leaves(g, w, f"{label}[{index}]")
    else:
        yield label, got, want


def deviation(got, want, dtype: torch.dtype = torch.float32, scale: float | None = None) -> float:
    """max |got - want| in units of eps(dtype) * max|want| (or eps * scale), the largest over
    every quantity compared (inf where shapes differ, or where want is zero and got is not)."""
    worst = 0.0
    for _, g, w in _leaves(got, want, ""):
        worst = max(worst, _quantity_deviation(g, w, dtype, scale))
    return worst


# Set by the pytest plugin while a test marked kernel_independent runs: it must not compare numbers.
forbidden_because: str | None = None


def _quantity_deviation(got, want, dtype, scale=None) -> float:
    if forbidden_because:
        raise AssertionError(f"{forbidden_because}, but compares numbers with the tolerance policy; "
                             f"remove the mark, or compare no numbers in this test")
    g, w = _as_tensor(got), _as_tensor(want)
    if g.shape != w.shape:
        return math.inf
    if not w.numel():
        return 0.0
    difference = (g - w).abs().max().item()
    if math.isnan(difference):
        return math.inf
    unit = eps(dtype) * (_magnitude(w) if scale is None else scale)
    if unit == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return difference / unit


def matches(got, want, dtype: torch.dtype = torch.float32, ulps: float | None = None,
            scale: float | None = None) -> bool:
    """Whether every quantity in `got` agrees with `want` under the policy (shapes and keys too)."""
    try:
        return deviation(got, want, dtype, scale) <= (ULPS[dtype] if ulps is None else ulps)
    except AssertionError:
        return False


def assert_matches(got, want, label: str = "", dtype: torch.dtype = torch.float32, ulps: float | None = None,
                   scale: float | None = None) -> None:
    """Assert that `got` agrees with `want` under the policy. `got` and `want`: tensors, numbers,
    lists of numbers, or dicts and lists of those. The message names the quantity, the deviation
    and the allowed one."""
    allowed = ULPS[dtype] if ulps is None else ulps
    for name, g, w in _leaves(got, want, label):
        found = _quantity_deviation(g, w, dtype, scale)
        _record(name, found, dtype)
        if found > allowed:
            g_t, w_t = _as_tensor(g), _as_tensor(w)
            detail = (f"shape {tuple(g_t.shape)} != {tuple(w_t.shape)}" if g_t.shape != w_t.shape
                      else f"max |got - want| = {(g_t - w_t).abs().max().item():.3g}, "
                           f"allowed {allowed_difference(w, dtype, allowed, scale):.3g}")
            raise AssertionError(
                f"{name or 'value'}: differs by {found:.3g} units of {dtype} eps x max|want| "
                f"(allowed {allowed:g}); {detail}\n  got:  {_short(g)}\n  want: {_short(w)}"
            )


def _short(value) -> str:
    text = repr(value.tolist() if isinstance(value, torch.Tensor) and value.numel() <= 8 else value)
    return text if len(text) <= 300 else text[:300] + " ..."


def _record(name: str, found: float, dtype: torch.dtype) -> None:
    path = os.environ.get("RANKRUN_DEVIATIONS")
    if not path:
        return
    entry = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "quantity": name,
        "dtype": str(dtype).removeprefix("torch."),
        "deviation": found if math.isfinite(found) else None,
        "kernels": os.environ.get("ATEN_CPU_CAPABILITY", "native"),
        "threads": os.environ.get("OMP_NUM_THREADS", ""),
    }
    with open(path, "a") as log:
        log.write(json.dumps(entry) + "\n")
