"""MkDocs hook: stamp every page with the versions its examples were run with.

- torch and DeepSpeed installed at build time: the environment that builds the site is the
  one the tests run the examples in, so this part of the stamp cannot drift from what was
  verified.
- The other DeepSpeed releases the page's examples were run on, from the version matrix's
  data (versions/matrix.json, written by `python3 tasks.py matrix`): a page that includes
  snippets of the matrix names the releases that every one of them ran on; the "DeepSpeed
  versions" page, which includes the matrix's generated summary, names every release that ran.
"""

from importlib.metadata import PackageNotFoundError, version

from rankrun.pages import include_specs  # the includes as pymdownx.snippets reads them
from versions.data import load_data, ran_releases  # the version matrix: standard library only
from versions.plan import commands, example_name, load_releases, release_key


def installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def on_config(config):
    config.extra["verified_with"] = {
        "torch": installed("torch"),
        "deepspeed": installed("deepspeed"),
    }
    return config


def releases_checked(markdown: str, data: dict, config: dict) -> list[str]:
    """The releases other than the installed one that ran every matrix example this page
    includes (an example planned on fewer releases narrows the list: the stamp never names a
    release that one of them did not run on); the versions page: every release that ran."""
    included = {spec.split(":", 1)[0] for _, spec in include_specs(markdown.splitlines())}
    ran = None
    if any(path.startswith("snippets/versions/") for path in included):
        ran = set()
        for command in commands(config):
            ran.update(ran_releases(data, command))
    else:
        for command in commands(config):
            if example_name(command) in included:
                here = set(ran_releases(data, command))
                ran = here if ran is None else ran & here
    ran = set(ran or ())
    ran.discard(installed("deepspeed"))
    return sorted(ran, key=release_key)


def on_page_markdown(markdown, page, config, files):
    page.meta["also_checked_with"] = releases_checked(markdown, load_data(), load_releases())
    return markdown
