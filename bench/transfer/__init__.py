"""Two-process NIXL (UCX) READ/WRITE throughput benchmark against same-process memcpy.

Run ``python -m bench.transfer --help``; see :mod:`bench.transfer.run` for the contract.
"""
