"""The home page lists every page of the navigation, under the navigation's section titles,
so every page and section is reachable from it (a page added to the nav but not to the
home page's tables fails here)."""

from mkdocs.utils.yaml import yaml_load

from rankrun.runner import ROOT


def nav_entries(nav, section=None):
    """(section title or None, page title, page path) for every page of mkdocs.yml's nav."""
    for item in nav:
        if isinstance(item, str):
            yield section, None, item
            continue
        (title, value), = item.items()
        if isinstance(value, list):
            yield from nav_entries(value, title)
        else:
            yield section, title, value


NAV = list(nav_entries(yaml_load((ROOT / "mkdocs.yml").read_text())["nav"]))
HOME = (ROOT / "docs" / "index.md").read_text()


def test_the_nav_has_the_pages_and_sections_this_test_reads():
    assert len(NAV) >= 12 and {section for section, _, _ in NAV if section} >= {
        "When something fails", "Building and initializing a model", "Reading shared weights in training",
        "Saving, loading and converting", "Generation and second models", "Pipelines and FSDP",
        "Tools and how the pages are tested"}


def test_every_page_of_the_nav_is_linked_from_the_home_page():
    missing = [path for _, _, path in NAV if path != "index.md" and f"]({path})" not in HOME]
    assert not missing, f"docs/index.md's tables do not link {missing}: add a row for each"


def test_every_section_of_the_nav_is_a_heading_of_the_home_page_with_its_pages_under_it():
    for section in dict.fromkeys(section for section, _, _ in NAV if section):
        heading = f"\n### {section}\n"
        assert heading in HOME, f"docs/index.md has no heading '### {section}'"
        under = HOME.split(heading, 1)[1].split("\n#", 1)[0]
        for _, _, path in (entry for entry in NAV if entry[0] == section):
            assert f"]({path})" in under, f"docs/index.md lists {path} outside its section {section!r}"


def test_the_home_page_lists_the_pages_in_the_order_of_the_navigation():
    """It says it does ("The pages in the order of the navigation")."""
    linked = [path for _, _, path in NAV if path != "index.md"]
    positions = [HOME.index(f"]({path})") for path in linked]
    assert positions == sorted(positions), (
        "docs/index.md lists the pages in another order than mkdocs.yml's nav: "
        f"{[path for _, path in sorted(zip(positions, linked))]}")
