"""Every snippet runs with its documented rank count and prints exactly its output file."""

from functools import cache

import pytest

from rankrun.pages import (ONLY_RANK_0, all_snippets, doc_pages, documented_world_size, normalise, output_blocks,
                           output_file, page_lines, page_name)
from rankrun.results import printed_by_the_example
from rankrun import runner

# Snippets that need more than the runner's default timeout: automatic_detection.py trains
# every case of its page's tables (78 ZeRO-3 runs) in one launch; under coverage on a loaded
# machine that took more than 120 s.
TIMEOUTS = {
    "snippets/zero3/automatic_detection.py": 600.0,
    # 13 ZeRO-3 trainings of a 4 MiB embedding; about 90 s in the warm pool on a loaded machine.
    "snippets/zero3/sharing_cost.py": 600.0,
    # Importing Transformers in new interpreters (below), on a loaded machine.
    "snippets/transformers/import_inside_zero_init.py": 600.0,
    "snippets/transformers/import_first_zero_init.py": 600.0,
    "snippets/transformers/hf_config_zero_init.py": 600.0,
    # Ten new interpreters of its own, most of them importing Transformers.
    "snippets/transformers/first_imports_inside_zero_init.py": 900.0,
    # Four Trainer runs, each followed by every save, then every load, in one launch.
    "snippets/transformers/zero3_saves.py": 600.0,
    # Twelve loads under ZeRO-3 and three Trainer runs in one launch.
    "snippets/transformers/load_under_zero3.py": 600.0,
}


def documented_run(snippet):
    """The snippet's run at its documented rank count (made once per test session): warm, fresh
    or through torchrun, as rankrun.runner.documented_run says (rankrun.pages.RUN_FRESH,
    RUN_BY_TORCHRUN)."""
    return runner.documented_run(snippet, timeout=TIMEOUTS.get(str(snippet), 120.0))


@pytest.mark.parametrize("snippet", all_snippets(), ids=str)
def test_snippet_prints_its_output_file(snippet, expect_output):
    expect_output(documented_run(snippet), output_file(snippet))


@cache
def output_labels() -> dict:
    """For each output file shown on a page: (page:line, the label before its block), each time."""
    labels = {}
    for page in doc_pages():
        for line, paragraph, outputs in output_blocks(page_lines(page)):
            for _, path in outputs:
                labels.setdefault(path.resolve(), []).append((f"docs/{page_name(page)}:{line}", normalise(paragraph)))
    return labels


def shown_on_several_ranks(snippet) -> bool:
    return documented_world_size(snippet) > 1 and output_file(snippet).resolve() in output_labels()


@pytest.mark.parametrize("snippet", [s for s in all_snippets() if shown_on_several_ranks(s)], ids=str)
def test_its_output_blocks_say_only_rank_0_prints_exactly_where_it_does(snippet):
    """A label says "only rank 0 prints" where the documented run's other ranks printed nothing,
    and only there (the run is the one the test above compares with the output file)."""
    result = documented_run(snippet)
    printing = [rank.rank for rank in result.ranks if printed_by_the_example(rank.stdout)]
    only_rank_0 = printing == [0]
    wrong = [f"{where}: {label[-100:]!r}" for where, label in output_labels()[output_file(snippet).resolve()]
             if (ONLY_RANK_0 in label) != only_rank_0]
    wanted = f"say {ONLY_RANK_0!r}" if only_rank_0 else f"not say {ONLY_RANK_0!r} (ranks {printing} print)"
    assert not wrong, f"labels of {output_file(snippet).name} must {wanted}:\n" + "\n".join(wrong)
