"""The one compiled part of the package: a cached call's path in C
(ditops/dispatch/cached_call.c). Optional: where it does not build, its Python twins run."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ditops.dispatch._cached_call", ["ditops/dispatch/cached_call.c"], optional=True)])
