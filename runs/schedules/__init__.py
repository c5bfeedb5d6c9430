"""User schedules, a product that starts runs: firing what is due (`services`). A schedule's
kinds, cron, next slot and check are `runs.inputs.schedules`.
"""
