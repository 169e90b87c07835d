"""Adapters from RL and agent frameworks' sandbox protocols to the broker (issue 39): each module implements one
framework's interface over ``tangram_client``, in at most 150 lines, importing the framework only where it must."""
