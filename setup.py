"""The one compiled part of the package: the plan lookup of a cached call
(ditops/dispatch/plan_lookup.c). Optional: where it does not build, its Python twin runs."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ditops.dispatch._plan_lookup", ["ditops/dispatch/plan_lookup.c"], optional=True)])
