"""Launcher side: host lists, local multi-host simulation, run reports."""
