"""Shared pytest fixtures. Each area adds its fixtures in a section of its own."""
