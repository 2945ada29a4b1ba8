"""The worker behind `ppqa run`: the claim/answer/settle loop (`loop`), when it claims
(`pacing`), leases (`lease`), per-job progress and reports (`report`) and the checks made
before any claim (`setup`)."""
