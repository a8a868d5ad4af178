"""The tolerance policy (rankrun.tolerance): what it accepts and refuses, and that the pages
state the figures the code uses."""

import math
import re

import pytest
import torch

from rankrun.runner import ROOT
from rankrun.tolerance import ULPS, assert_matches, deviation, eps, matches


def neighbours(value: float, steps: int) -> float:
    """The float32 value `steps` representable values above `value`."""
    x = torch.tensor(value, dtype=torch.float32)
    for _ in range(steps):
        x = torch.nextafter(x, torch.tensor(math.inf))
    return x.item()


def test_a_reordered_sum_passes_where_a_fixed_1e_6_failed():
    """The loss a reader's AVX-512 machine printed against plain PyTorch's: 1.9e-6 apart."""
    assert abs(9.621566772460938 - 9.62156867980957) > 1e-6
    assert_matches(9.621566772460938, 9.62156867980957, "loss")
    assert_matches([9.621566772460938, 3.0], [9.62156867980957, 3.0], "losses")


def test_the_bound_is_relative_to_the_largest_value():
    big = 9.62156867980957
    assert matches(neighbours(big, 60), big)
    assert not matches(neighbours(big, 140), big)  # 140 spacings near 9.6 are more than 64 eps x 9.6
    # an entry near zero may carry the rounding of the large entries beside it...
    want = torch.tensor([100.0, 1e-4])
    assert matches(want + torch.tensor([0.0, 5e-4]), want)
    # ...but not a difference a real bug makes
    assert not matches(want + torch.tensor([0.0, 1e-2]), want)


def test_real_differences_fail_with_a_message_that_names_the_quantity():
    with pytest.raises(AssertionError, match=r"^step 0 grads\['w'\]: differs by .* units of torch.float32 eps"):
        assert_matches({"w": torch.tensor([1.0, 2.001])}, {"w": torch.tensor([1.0, 2.0])}, "step 0 grads")
    with pytest.raises(AssertionError, match=r"shape \(3,\) != \(2,\)"):
        assert_matches(torch.zeros(3), torch.zeros(2), "w")
    with pytest.raises(AssertionError, match=r"keys \['a'\] != \['b'\]"):
        assert_matches({"a": 1.0}, {"b": 1.0}, "grads")
    assert not matches(float("nan"), 1.0)


def test_a_zero_reference_is_matched_exactly():
    assert matches(torch.zeros(4), torch.zeros(4))
    assert not matches(torch.tensor([0.0, 1e-30]), torch.zeros(2))
    assert deviation(torch.tensor([1e-30]), torch.zeros(1)) == math.inf


def test_a_cancelling_sum_is_compared_at_the_scale_of_its_terms():
    terms = torch.tensor([1000.0, -1000.0, 1e-3])
    assert not matches(1e-3 + 1e-6, 1e-3)
    assert matches(1e-3 + 1e-6, 1e-3, scale=terms.abs().sum().item())


def test_bf16_has_its_own_count():
    assert eps(torch.bfloat16) == 2**-7
    assert matches(1.0 + 3 * 2**-7, 1.0, dtype=torch.bfloat16)
    assert not matches(1.0 + 3 * 2**-7, 1.0)


def test_the_testing_page_states_the_figures_the_code_uses():
    page = (ROOT / "docs/testing.md").read_text()
    count = ULPS[torch.float32]
    assert f"max |got - want|  <=  {count} × eps(float32) × max |want|" in page
    assert f"`{count * eps():.1e}`".replace("e-06", "e-6") in page  # 7.6e-6
    assert "`eps = 2**-23`" in page and eps() == 2**-23
    # every page that names the tolerance in epsilons names this count
    for path in sorted((ROOT / "docs").rglob("*.md")):
        for found in re.findall(r"(\d+) float32 epsilons", path.read_text()):
            assert int(found) == count, path
