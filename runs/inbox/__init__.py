"""The webhook inbox, a product that starts runs: signatures (`signing`: the timestamped and
body-only schemes), receipt (`receipt`), attempts (`attempts`), processing by the workers
(`processing`: leases, claims), the desk's retry, force and resolve (`desk`), stored secrets
(`secrets`) and the inbox's refusals (`refusals`). A source's configuration rule is
`runs.inputs.sources`.
"""
