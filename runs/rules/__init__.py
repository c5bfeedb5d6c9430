"""The rules: what may happen, decided on facts read from the ledger.

Replay (`replay`) and resume (`resume`), every "who may" (`permissions`), who sees which
runs (`visibility`), for which owners a person may act (`owners`), caps on work in flight
(`quotas`), scripted faults (`faults`), the desk's sets of what needs a person (`overview`), each
call's honest state (`call_states`) and what a failed run tells API users (`public_text`). They
read and refuse; they write nothing.
"""
