"""EPD: aggregated vs E/PD vs E/P/D under a mixed text and image load (TTFT, ITL, goodput,
text TTFT while images are encoded).

Run ``python -m bench.epd --help``; see :mod:`bench.epd.run` for the contract.
"""
