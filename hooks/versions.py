"""MkDocs hook: stamp every page with the torch and DeepSpeed versions installed at build time.

The versions come from the environment that builds the site, the same one the
tests run the examples in, so the stamp cannot drift from what was verified.
"""

from importlib.metadata import PackageNotFoundError, version


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

