"""Trace-driven simulation of the broker and of what users run today (paper §2.3, §6).

The simulator runs on a virtual clock and drives the broker's own queue, scheduler, duration model and the
managers' allocation code (CPU cores per node, GPU chunks and residency, API quota windows); only execution is
modelled. Baselines (a pod per trajectory, fixed DoP, a static GPU deployment, API calls without traffic control)
are modelled beside it on the same traces, so each figure is a ratio measured in one run.
"""
