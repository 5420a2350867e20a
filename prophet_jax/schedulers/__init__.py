"""Scheduling policies: pure factories returning Scheduler callables."""
