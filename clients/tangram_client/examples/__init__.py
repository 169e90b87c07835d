"""Runnable examples of the clients (see each module's docstring)."""
