"""The broker's version, as the installed distribution says (``tangram --version``, ``tangram_build_info``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("arl-tangram")
except PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0+unknown"
