"""Byte units, each defined once. Memory sizes in specs and catalogs are in GiB (2**30 bytes), as
drivers report device memory; the planner and the profiler work in bytes."""

KIB = 2**10
MIB = 2**20
GIB = 2**30
TIB = 2**40
