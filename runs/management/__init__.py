"""The app's commands (`manage.py run_agent`, `runworker`, `serve`, `seed_demo`, …): doors onto
the services, the worker and upkeep.
"""
