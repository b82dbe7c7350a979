"""The harness of the Neural Process models: training, evaluation, tasks and their data, reports.

Run from a clone through ``python -m bench train|eval|bandit|memory``; not part of the installed package.
"""
