"""The build backend (pyproject.toml): setuptools' own, less one notice that does not apply here.

setuptools announces every editable install of a mapped layout like this one (`specctl.*` packages
from top-level folders) with "Editable installation ... be careful with folders in your working
directory with the same name as your package"; pip shows it as a warning. No folder here is named
`specctl`, so it is silenced, and only it: every other warning passes through."""

import warnings

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - the rest of the PEP 517/660 hooks, unchanged
from setuptools.warnings import InformationOnly


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Editable installation\.", category=InformationOnly)
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
