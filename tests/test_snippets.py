"""Every snippet runs with its documented rank count and prints exactly its output file."""

import pytest

from examples import all_snippets, documented_world_size, output_file
from runner import run_snippet


@pytest.mark.parametrize("snippet", all_snippets(), ids=str)
def test_snippet_prints_its_output_file(snippet, expect_output):
    result = run_snippet(snippet, world_size=documented_world_size(snippet))
    expect_output(result, output_file(snippet))
