"""The reasons a test's outcome does not depend on PyTorch's CPU kernels, as pytest marks
(`kernel_independent`, rankrun.plugin): `.ci/run`'s second pass under
`ATEN_CPU_CAPABILITY=default` leaves these tests out and lists them with their reason; a marked
test that compares numbers fails (the plugin checks it in every run).

    from rankrun import marks

    @marks.refusal
    def test_a_rank_count_that_does_not_split_the_batch_is_refused(): ...
"""

import pytest

refusal = pytest.mark.kernel_independent(
    reason="a refusal of a rank count, raised before any computation: its message and the empty output")
message = pytest.mark.kernel_independent(
    reason="an example meant to fail: its exception and message, raised before it prints a number")
hang = pytest.mark.kernel_independent(
    reason="a hang and where each rank waits; the tokens printed before it are compared with one process "
           "by the generate test that stays in the pass")
first_imports = pytest.mark.kernel_independent(
    reason="which first imports inside zero.Init raise, and their messages")
files = pytest.mark.kernel_independent(reason="a check of pages and committed files: no run, no computation")
api = pytest.mark.kernel_independent(reason="a fact of the installed library's API, computed nothing")
shapes = pytest.mark.kernel_independent(
    reason="shapes, names and ties of partitioned parameters: no computed value")
findings = pytest.mark.kernel_independent(
    reason="the shared-reads checker's findings: which parameter was read where, no computed value")

# Not a mark: why `--smallest-rank-count` (the same pass) leaves a test out: its comparison with
# one process runs at a smaller rank count, through the same CPU kernels on smaller shards.
SMALLER_RANK_COUNT = "the same comparison, through the same CPU kernels, runs at a smaller rank count in {kept}"
