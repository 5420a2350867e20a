"""Bundled GradientProfile traces (JSON)."""
