"""TTFT cost of prefill/decode disaggregation (pull, push) against aggregated serving,
next to the raw NIXL time of moving the prompt's KV.

Run ``python -m bench.pd_overhead --help``; see :mod:`bench.pd_overhead.run` for the contract.
"""
