"""Compiled programs: HLO reading, the audit, compile-only GPU targets, jax version checks."""
