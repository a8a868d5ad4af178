"""`--changed`: which tests a change selects, on this project's own snippets and pages."""

from rankrun.changed import affected
from rankrun.pages import pages_including
from rankrun.plugin import outputs_shown

SNIPPET = "snippets/zero3/free_active_param.py"
PAGE = "docs/zero3/cannot-free.md"  # shows that snippet's output
LABEL_ITEM = f"tests/test_snippets.py::test_its_output_blocks_say_only_rank_0_prints_exactly_where_it_does[{SNIPPET}]"
OUTPUT_ITEM = f"tests/test_snippets.py::test_snippet_prints_its_output_file[{SNIPPET}]"
OTHER_SNIPPET_ITEM = "tests/test_snippets.py::test_snippet_prints_its_output_file[snippets/zero3/module_z3.py]"


def test_a_changed_snippet_selects_its_tests_and_its_pages_checks():
    what = affected([SNIPPET], pages_including, outputs_shown)
    assert not what.everything
    assert what.selects("tests/zero3/test_free_active_param.py::test_anything")
    assert what.selects(OUTPUT_ITEM) and what.selects(LABEL_ITEM)
    assert not what.selects(OTHER_SNIPPET_ITEM)
    assert PAGE in what.pages
    assert what.selects(f"tests/test_output_blocks.py::test_every_output_block_is_labelled_for_what_it_is[{PAGE[5:]}]")


def test_a_changed_page_selects_the_label_checks_of_the_outputs_it_shows_only():
    """A page's labels are checked against the runs of the examples it shows: those items, not
    the examples' other tests."""
    assert "snippets/zero3/free_active_param.out" in outputs_shown(PAGE)
    what = affected([PAGE], pages_including, outputs_shown)
    assert what.selects(LABEL_ITEM)
    assert not what.selects(OUTPUT_ITEM)
    assert not what.selects("tests/zero3/test_free_active_param.py::test_anything")
    assert what.selects("tests/test_site.py::test_strict_build")


def test_the_harness_selects_everything():
    assert affected(["rankrun/runner.py"], pages_including, outputs_shown).selects(OTHER_SNIPPET_ITEM)


def test_only_the_files_that_may_hold_a_selected_test_are_collected():
    """pytest_ignore_collect (rankrun.plugin) skips the other test modules: importing them
    costs seconds in every worker, for nothing."""
    page = affected([PAGE], pages_including, outputs_shown)
    for path in ("tests/test_snippets.py", "tests/test_prose_literals.py", "tests/test_output_blocks.py",
                 "tests/test_inventory.py", "tests/test_site.py"):
        assert page.may_select_file(path), path
    for path in ("tests/zero3/test_free_active_param.py", "tests/site/test_browser.py", "rankrun/tests/test_runner.py",
                 "tests/test_versions.py"):
        assert not page.may_select_file(path), path
    snippet = affected([SNIPPET], pages_including, outputs_shown)
    assert snippet.may_select_file("tests/zero3/test_free_active_param.py")
    assert not snippet.may_select_file("tests/zero3/test_module_z3.py")
    assert affected(["rankrun/runner.py"], pages_including, outputs_shown).may_select_file("tests/zero3/test_module_z3.py")


def test_a_changed_page_leaves_out_the_slow_checks_of_the_machinery():
    """Real torchrun's stderr and builds of broken copies: a page's text cannot break them; a
    change of an example such a check runs (its @pytest.mark.runs) selects it."""
    torchrun_check = "tests/test_output_blocks.py::test_torchrun_warnings_of_a_training_example"
    broken_build = "tests/test_site.py::test_missing_snippet_file_fails_the_build"
    page = affected([PAGE], pages_including, outputs_shown)
    assert not page.selects(torchrun_check, slow=True, runs=("snippets/zero3/language_model.py",))
    assert not page.selects(broken_build, slow=True)
    assert page.selects("tests/test_site.py::test_site_builds_strict")
    example = affected(["snippets/zero3/language_model.py"], pages_including, outputs_shown)
    assert example.selects(torchrun_check, slow=True, runs=("snippets/zero3/language_model.py",))
    assert not affected([SNIPPET], pages_including, outputs_shown).selects(
        torchrun_check, slow=True, runs=("snippets/zero3/language_model.py",))
    assert affected(["hooks/notebooks.py"], pages_including, outputs_shown).selects(broken_build, slow=True)


def test_the_data_of_find_your_error_selects_its_tests_and_the_build():
    """docs/errors/*.toml is no page, yet the two pages are rendered from it."""
    what = affected(["docs/errors/threads/huggingface-peft.toml"], pages_including, outputs_shown)
    assert not what.everything
    assert what.selects("tests/test_errors_data.py::test_anything")
    assert what.selects("tests/site/test_find_your_error.py::test_searching_for_the_message_lands_on_its_entry_first[x]",
                        slow=True)
    assert what.selects("tests/test_site.py::test_strict_build")
    assert not what.selects("tests/site/test_browser.py::test_light_dark_toggle")
    hooks = affected(["hooks/errors_pages.py"], pages_including, outputs_shown)
    assert hooks.site and hooks.selects("tests/test_errors_data.py::test_anything")
