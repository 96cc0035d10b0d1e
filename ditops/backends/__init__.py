"""Backends: each module holds one function per op it implements; the registry says who runs what."""
